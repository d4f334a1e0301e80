"""Beam search's types, as vLLM's (`vllm/beam_search.py`, and `BeamSearchParams` from `vllm/sampling_params.py`):
what `LLM.beam_search` takes and returns, and its score."""
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanovllm.outputs import Logprob


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters. Each step, every live beam of a prompt is extended by its `2 * beam_width`
    most likely next tokens (and, at `temperature` > 0, the token it samples), and the `beam_width` best of all
    these, by `get_beam_search_score`, live on; an extension by EOS (unless `ignore_eos`) ends there, set aside.
    After `max_tokens` steps the `beam_width` best of the ended and the live beams are returned. `temperature` 0
    (the default) is greedy, and then only the top tokens are candidates. `length_penalty` divides a beam's
    cumulative log-probability by its length (prompt included) to this power. `include_stop_str_in_output` is
    vLLM's field; as in vLLM's `LLM.beam_search` it changes nothing (a beam's `tokens` and `text` keep its EOS)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, valid, ok in (("temperature", ">= 0 (0 is greedy)", lambda v: v >= 0),
                                ("length_penalty", "(any finite number)", lambda v: True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not ok(value):
                raise ValueError(f"{name} must be a number {valid}, got {value!r}")
            setattr(self, name, float(value))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: `tokens` are the prompt's and the generated ones (an EOS that ended it included);
    `logprobs` has, per generated token, the candidates of that step (the token its parent beam sampled first,
    then the `2 * beam_width` most likely, by rank), shared by the beams that step extended the same beam with;
    `cum_logprob` is the sum of its generated tokens' log-probabilities; `text` decodes `tokens` (prompt
    included, as vLLM's). `finish_reason` is "stop" (it ended with EOS; `stop_reason` is the EOS id) or "length"
    (`max_tokens` or `max_model_len`), the values vLLM's server reports (vLLM's `LLM.beam_search` leaves both
    None). `lora_request`: the LoRA adapter its prompt ran under (None: the base model)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score (after transformers'): the cumulative log-probability divided by the length to the power
    `length_penalty`, the length counting the prompt and not a final EOS."""
    seq_len = len(tokens)
    if tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len ** length_penalty)


def create_sort_beams_key_function(eos_token_id: int, length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    """A sort key scoring a `BeamSearchSequence` by `get_beam_search_score`."""
    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key
