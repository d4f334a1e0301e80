"""vLLM's `vllm.logprobs`: a token's `Logprob`, the per-position lists of them that outputs hold, and `FlatLogprobs`,
the flat form `SamplingParams(flat_logprobs=True)` asks for."""
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from nanovllm.outputs import Logprob

LogprobsOnePosition = dict[int, Logprob]
"""One position's log-probabilities: token id -> `Logprob`."""


@dataclass
class FlatLogprobs(Sequence[LogprobsOnePosition]):
    """A request's logprobs in vLLM's flat form: every position's tokens in four flat lists (`token_ids`, `logprobs`,
    `ranks`, `decoded_tokens`), position i holding entries `start_indices[i]` to `end_indices[i]` (exclusive), so a
    long output keeps a few lists instead of a dict and a `Logprob` per token. It reads as the list of dicts it
    stands for: `flat[i]` is position i's `{token id: Logprob}` (empty for a position without logprobs, as the
    prompt's first), a slice is a `FlatLogprobs`, and it iterates position by position."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    @classmethod
    def of(cls, positions: list[LogprobsOnePosition | None]) -> "FlatLogprobs":
        """The flat form of a list of per-position dicts (None for a position without logprobs)."""
        flat = cls()
        for position in positions:
            flat.append(position)
        return flat

    def append(self, position: LogprobsOnePosition | None) -> None:
        """Add the next position's logprobs (None or {} for none)."""
        self.start_indices.append(len(self.token_ids))
        for token_id, logprob in (position or {}).items():
            self.token_ids.append(token_id)
            self.logprobs.append(logprob.logprob)
            self.ranks.append(logprob.rank)
            self.decoded_tokens.append(logprob.decoded_token)
        self.end_indices.append(len(self.token_ids))

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index: int | slice) -> "LogprobsOnePosition | FlatLogprobs":
        if isinstance(index, slice):
            return FlatLogprobs.of([self[i] for i in range(*index.indices(len(self)))])
        start, end = self.start_indices[index], self.end_indices[index]
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(start, end)}

    def __iter__(self) -> Iterator[LogprobsOnePosition]:
        return (self[i] for i in range(len(self)))


PromptLogprobs = FlatLogprobs | list[LogprobsOnePosition | None]
"""`RequestOutput.prompt_logprobs`: one dict per prompt token, None for the first (or their `FlatLogprobs`)."""
SampleLogprobs = FlatLogprobs | list[LogprobsOnePosition]
"""`CompletionOutput.logprobs`: one dict per generated token (or their `FlatLogprobs`)."""

__all__ = ["FlatLogprobs", "Logprob", "LogprobsOnePosition", "PromptLogprobs", "SampleLogprobs"]
