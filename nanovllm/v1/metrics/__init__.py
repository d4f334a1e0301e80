"""vLLM's `vllm.v1.metrics`: its `reader` module (the metric objects `LLM.get_metrics()` returns)."""
