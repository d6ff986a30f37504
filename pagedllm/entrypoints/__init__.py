"""What users call: the offline LLM, the CLI, the OpenAI-compatible server."""
