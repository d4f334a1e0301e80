"""vLLM's `vllm.v1.sample.logits_processor.interface` (`nanovllm.logits_processor`)."""
from nanovllm.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest", "RemovedRequest"]
