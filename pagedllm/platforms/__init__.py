"""The CPU platform: kernel builds and ISA dispatch, allocator tuning."""
