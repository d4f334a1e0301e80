"""The pooling runner's share of a step (rank 0): each sequence's rows of the step's hidden states pooled, across the
steps its prompt takes (chunked prefill), and the outputs its task asks for, once its prompt is computed."""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.config import PoolerConfig
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.layers.pooler import Pooler, activate, normalized


@dataclass
class PooledOutput:
    """A pooling step's results: for each sequence whose prompt the step completed, by id, its output on the CPU in
    float32 (a vector; one row per prompt token for the per-token tasks)."""

    data: dict[int, torch.Tensor]


def step_token_types(batch: ScheduledBatch) -> list[int] | None:
    """The token type of every row of the step (`Sequence.token_type_ids`, 0 where a sequence has none), or None
    when all are 0."""
    if all(seq.token_type_ids is None for seq in batch.seqs):
        return None
    types = []
    for seq, start, num_tokens in zip(batch.seqs, batch.starts, batch.num_tokens):
        types += seq.token_type_ids[start:start + num_tokens] if seq.token_type_ids else [0] * num_tokens
    return types


class StepPooler:
    """Pools `model`'s hidden states (`nanovllm.models.pooling`) as `config` says. A prompt computed in several steps
    keeps its partial result here between them (`Pooler.accumulate`); one whose computation starts over (preempted)
    drops it, and `release` drops those of sequences that ended before their prompt did (aborted)."""

    def __init__(self, model: nn.Module, config: PoolerConfig):
        self.model = model
        self.config = config
        self.partial: dict[int, torch.Tensor | list[torch.Tensor]] = {}

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.partial.pop(seq_id, None)

    @torch.inference_mode()
    def __call__(self, hidden_states: torch.Tensor, batch: ScheduledBatch) -> PooledOutput:
        pooled: list[tuple[Sequence, torch.Tensor]] = []
        row = 0
        for seq, start, num_tokens, last in zip(batch.seqs, batch.starts, batch.num_tokens, batch.samples):
            rows = hidden_states[row:row + num_tokens]
            row += num_tokens
            kind = "ALL" if seq.pooling.task.startswith("token_") else self.model.pooler.pooling_type
            previous = self.partial.pop(seq.seq_id, None)
            partial = Pooler.accumulate(kind, rows, start == 0, None if start == 0 else previous)
            if last:
                pooled.append((seq, Pooler.finish(kind, rows, partial, len(seq))))
            elif partial is not None:
                self.partial[seq.seq_id] = partial
        results = self._heads(pooled)
        if not results:
            return PooledOutput({})
        on_host = torch.cat([result.float().flatten() for _, result in results]).cpu()  # one transfer
        parts = on_host.split([result.numel() for _, result in results])
        return PooledOutput({seq.seq_id: part.view(result.shape) for (seq, result), part in zip(results, parts)})

    def _heads(self, pooled: list[tuple[Sequence, torch.Tensor]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Each pooled prompt through its task's head: embeddings through the Dense layers, cut to `dimensions` and
        normalized as asked; a classifier's `score` outputs through its activation unless `use_activation=False`.
        Vectors of one kind go through their head together."""
        outputs = []
        for task in ("embed", "classify", "score"):
            group = [(seq, vector) for seq, vector in pooled if seq.pooling.task == task]
            if not group:
                continue
            stacked = torch.stack([vector for _, vector in group])
            results = self.model.pooler.embed(stacked) if task == "embed" else self.model.score(stacked)
            outputs += [(seq, self._finish(seq, result)) for (seq, _), result in zip(group, results)]
        for seq, rows in pooled:
            if seq.pooling.task == "token_embed":
                outputs.append((seq, self._finish(seq, self.model.pooler.embed(rows))))
            elif seq.pooling.task == "token_classify":
                outputs.append((seq, self._finish(seq, self.model.score(rows))))
        return outputs

    def _finish(self, seq: Sequence, result: torch.Tensor) -> torch.Tensor:
        params = seq.pooling
        if params.task in ("embed", "token_embed"):
            return normalized(result, params.normalize, params.dimensions)
        return activate(result, self.config.activation) if params.use_activation else result
