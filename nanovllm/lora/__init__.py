"""vLLM's `vllm.lora` path: `nanovllm.lora.request.LoRARequest`, so that clients that import it load. nanovllm has no
LoRA adapters: the methods that take a `lora_request` take None only."""
