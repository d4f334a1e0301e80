"""vLLM's `vllm.v1.sample.logits_processor`: the custom logits processor interface (`nanovllm.logits_processor`), the
adapter for per-request callables, and the loading and checks the engine applies to `LLM(logits_processors=...)`.
`LOGITSPROCS_GROUP` names vLLM's entry-point group of installed processors, which nanovllm does not load (processors
are named in `LLM(logits_processors=...)`)."""
from nanovllm.config import POOLING_REJECTS_LOGITS_PROCESSORS as STR_POOLING_REJECTS_LOGITSPROCS
from nanovllm.config import SPEC_DECODE_REJECTS_LOGITS_PROCESSORS as STR_SPEC_DEC_REJECTS_LOGITSPROCS
from nanovllm.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
    validate_logits_processors_parameters,
)

LOGITSPROCS_GROUP = "vllm.logits_processors"

__all__ = ["LOGITSPROCS_GROUP", "AdapterLogitsProcessor", "BatchUpdate", "LogitsProcessor", "MoveDirectionality",
           "RequestLogitsProcessor", "STR_POOLING_REJECTS_LOGITSPROCS", "STR_SPEC_DEC_REJECTS_LOGITSPROCS",
           "validate_logits_processors_parameters"]
