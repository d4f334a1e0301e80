"""nanovllm: `LLM(model).generate(prompts, SamplingParams(...))`.

`LLM` and `default_model` are imported on first use, so that `import nanovllm` (and
`python -m nanovllm --help`) does not pay for torch and transformers. `as_vllm()` makes `import vllm` give nanovllm,
for clients written for vLLM (`nanovllm.vllm_alias`).
"""
from importlib import import_module

from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from nanovllm.inputs import PromptType, TextPrompt, TokensPrompt
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.vllm_alias import as_vllm

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput", "ClassificationRequestOutput",
           "ScoringRequestOutput",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "PromptType", "TextPrompt", "TokensPrompt",
           "as_vllm", "default_model"]

_LAZY = {"LLM": "nanovllm.llm", "default_model": "nanovllm.smollm2"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
