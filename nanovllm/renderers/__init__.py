"""vLLM's `vllm.renderers` path: `nanovllm.renderers.hf`, the chat template of a Hugging Face tokenizer."""
