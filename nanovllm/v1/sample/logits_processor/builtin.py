"""vLLM's `vllm.v1.sample.logits_processor.builtin`: its helper for processors that keep per-request state in a dict
(`nanovllm.logits_processor.process_dict_updates`). vLLM's built-in processors (min_tokens, logit bias, min-p) are
nanovllm's sampler's own stages."""
from nanovllm.logits_processor import process_dict_updates

__all__ = ["process_dict_updates"]
