"""The step loop (LLMEngine) and its asyncio front (AsyncEngine)."""
