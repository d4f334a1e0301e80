"""vLLM's `vllm.v1.sample.logits_processor`: the custom logits processor interface (`nanovllm.logits_processor`), the
adapter for per-request callables, and the loading and checks the engine applies to `LLM(logits_processors=...)`."""
from nanovllm.config import SPEC_DECODE_REJECTS_LOGITS_PROCESSORS as STR_SPEC_DEC_REJECTS_LOGITSPROCS
from nanovllm.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
    validate_logits_processors_parameters,
)

__all__ = ["AdapterLogitsProcessor", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "RequestLogitsProcessor",
           "STR_SPEC_DEC_REJECTS_LOGITSPROCS", "validate_logits_processors_parameters"]
