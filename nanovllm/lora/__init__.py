"""LoRA adapters per request (vLLM's `vllm.lora` path: `nanovllm.lora.request.LoRARequest`): PEFT directories read
(`peft.py`), mapped onto the decoder's projections (`targets.py`) and kept in an LRU, each step's tokens grouped by
adapter (`manager.py`); the per-token arithmetic is `nanovllm.layers.lora`, the one-adapter-too-many rule the
scheduler's."""
