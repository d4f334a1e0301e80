"""What `generate` returns, shaped as vLLM's outputs."""
from dataclasses import dataclass


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
    """When things happened to a request, in `time.time()` seconds: it arrived, got its first and its latest token,
    and finished (None until then)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


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

    def __getitem__(self, key: str):
        if key not in LEGACY_KEYS:
            raise KeyError(f"{key!r}: a RequestOutput can be indexed only by {LEGACY_KEYS}; "
                           "use its attributes (outputs, prompt, prompt_token_ids, ...) for the rest")
        return getattr(self.outputs[0], key)
