"""vLLM's `vllm.entrypoints.llm`: the `LLM` class (`nanovllm.llm`)."""
from nanovllm.llm import LLM

__all__ = ["LLM"]
