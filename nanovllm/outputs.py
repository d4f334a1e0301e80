"""What `generate` returns, shaped as vLLM's outputs (the pooling methods' outputs are in `nanovllm.pooling_outputs`,
importable from here as from `vllm.outputs`)."""
from dataclasses import dataclass
from typing import Any

from nanovllm.pooling_outputs import ClassificationOutput as ClassificationOutput
from nanovllm.pooling_outputs import ClassificationRequestOutput as ClassificationRequestOutput
from nanovllm.pooling_outputs import EmbeddingOutput as EmbeddingOutput
from nanovllm.pooling_outputs import EmbeddingRequestOutput as EmbeddingRequestOutput
from nanovllm.pooling_outputs import PoolingOutput as PoolingOutput
from nanovllm.pooling_outputs import PoolingRequestOutput as PoolingRequestOutput
from nanovllm.pooling_outputs import ScoringOutput as ScoringOutput
from nanovllm.pooling_outputs import ScoringRequestOutput as ScoringRequestOutput


@dataclass
class Logprob:
    """One token's log-probability; `rank` 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request. `finish_reason` is "stop" (EOS, a stop token or string), "length" or "abort", None
    while running; `stop_reason` is the stop string or stop token id that ended it (None for EOS). `logprobs` has, per
    generated token, a dict from token id to its Logprob: the sampled token and the requested top ones."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and rank (1 is the most likely), and the `params.logprobs` most likely
    tokens' ids and log-probabilities, most likely first."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


LEGACY_KEYS = ("text", "token_ids")


@dataclass
class RequestMetrics:
    """What happened to a request so far, as vLLM V1's `RequestStateStats` (its `RequestOutput.metrics`), recorded
    by the engine where each event happens: `arrival_time` (submitted to `LLM`), `queued_ts` (queued in the engine
    that runs it: a data-parallel replica's is later than the front's arrival), `scheduled_ts` (a step first
    computed some of its prompt; a preemption does not move it), `first_token_ts` and `last_token_ts` (the steps
    that gave it its first and its latest token), `first_token_latency` (`first_token_ts - arrival_time`) and
    `num_generation_tokens` (tokens generated, summed over its `n` completions). A timestamp is 0.0 until its event.
    Unlike vLLM, whose engine core stamps the `_ts` fields with `time.monotonic()`, every time here is `time.time()`
    seconds, so they compare with `arrival_time` and with each other across processes. `is_corrupted` (vLLM's NaN
    check) is always False here.

    nanovllm adds the prompt's tokens, those of them the prefix cache served (`RequestOutput.num_cached_tokens`),
    `finished_time` (None until it finished or was aborted), and `first_token_time` / `last_token_time`, its earlier
    names for `first_token_ts` / `last_token_ts` (None until then). Each output carries the metrics as they were
    when it was made."""

    arrival_time: float
    num_generation_tokens: int = 0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
    is_corrupted: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finished_time: float | None = None

    @property
    def first_token_time(self) -> float | None:
        return self.first_token_ts or None

    @property
    def last_token_time(self) -> float | None:
        return self.last_token_ts or None


@dataclass
class RequestOutput:
    """One request: its prompt and its `n` completions. `prompt_logprobs` (with `SamplingParams.prompt_logprobs`) has
    None for the first prompt token, then per token a dict from token id to Logprob (the prompt's token and the most
    likely ones); `num_cached_tokens`: prompt tokens served from the prefix cache. `out["text"]` and
    `out["token_ids"]` read the first completion, as nano-vLLM's dict outputs did."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    lora_request: Any = None  # the request's `nanovllm.lora.request.LoRARequest` (None: the base model)

    def __getitem__(self, key: str):
        if key not in LEGACY_KEYS:
            raise KeyError(f"{key!r}: a RequestOutput can be indexed only by {LEGACY_KEYS}; "
                           "use its attributes (outputs, prompt, prompt_token_ids, ...) for the rest")
        return getattr(self.outputs[0], key)
