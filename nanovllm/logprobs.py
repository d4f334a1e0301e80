"""vLLM's `vllm.logprobs`: a token's `Logprob` and the per-position lists of them that outputs hold."""
from nanovllm.outputs import Logprob

LogprobsOnePosition = dict[int, Logprob]
"""One position's log-probabilities: token id -> `Logprob`."""
PromptLogprobs = list[LogprobsOnePosition | None]
"""`RequestOutput.prompt_logprobs`: one dict per prompt token, None for the first."""
SampleLogprobs = list[LogprobsOnePosition]
"""`CompletionOutput.logprobs`: one dict per generated token."""

__all__ = ["Logprob", "LogprobsOnePosition", "PromptLogprobs", "SampleLogprobs"]
