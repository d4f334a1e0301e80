"""vLLM's `vllm.v1.sample`: its `logits_processor` package."""
