"""vLLM's `vllm.logger.init_logger` under nanovllm's name, for code written against vLLM (custom logits processors log
through it)."""
import logging


def init_logger(name: str) -> logging.Logger:
    """The standard library's logger `name` (vLLM's per-module loggers; nanovllm's own is "nanovllm")."""
    return logging.getLogger(name)
