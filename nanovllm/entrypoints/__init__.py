"""vLLM's `vllm.entrypoints`: its `llm` module (`LLM`)."""
