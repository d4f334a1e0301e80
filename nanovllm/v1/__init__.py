"""vLLM V1's module paths with the package name changed, so code written for vLLM V1 imports what nanovllm has of it
with `vllm` replaced by `nanovllm`: `nanovllm.v1.sample.logits_processor` (custom logits processors). Thin re-exports
only: nothing in nanovllm imports them, and what they name lives where the rest of nanovllm finds it."""
