"""`pagedllm bench ...`: throughput, latency, serve, memory, roofline."""
