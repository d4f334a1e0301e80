"""vLLM V1's custom logits processors in the sampler (`LLM(logits_processors=[...])`, the interface in
`nanovllm.logits_processor`): one instance of each class, built on the rank that samples, and the batch they see.

vLLM's processors address a request by its index in the engine's persistent batch, which is told to them as it
changes, and get the step's logits with row i for index i. nanovllm has no persistent batch: a step's logits rows
are its sequences that sample, in the scheduler's order. `ProcessorBatch` keeps one for the processors, as vLLM's
input batch keeps its indices:

- the batch is the step's sampling rows: a sequence joins it (added, with its params, prompt token ids and its own
  output token list) in the first step it samples, and leaves it (removed) in the first step it does not: it
  finished, was aborted or preempted, or was not scheduled (a preempted sequence joins again when it next samples,
  with the same output list, which keeps every token it had);
- an index, once given, stays the sequence's while it is in the batch; a new sequence takes the lowest free index;
  free indices left below the last are filled by moving the last sequences into them (unidirectional moves), so the
  indices are always 0 to `batch_size` - 1;
- a sequence's output token list is synced with its tokens before each step's `update_state`, so processors that
  keep it read every token the engine appended;
- each step the logits rows are gathered into index order for the processors and scattered back (nothing is
  copied while the two orders agree, as they do until a sequence leaves from the middle); no host sync.
"""
import heapq
from collections.abc import Iterable, Sequence

import torch

from nanovllm.config import Config, VllmConfig
from nanovllm.execution.step_inputs import to_device
from nanovllm.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    load_logits_processor_classes,
)


def build_logits_processors(config: Config, device: torch.device) -> "ProcessorBatch | None":
    """The engine's custom logits processors (`config.logits_processors`, each class built once as vLLM builds it),
    or None when there are none."""
    classes = load_logits_processor_classes(config.logits_processors)
    if not classes:
        return None
    vllm_config = VllmConfig(config)
    return ProcessorBatch([cls(vllm_config, device, device.type == "cuda") for cls in classes], device)


class ProcessorBatch:
    """The custom logits processors and the persistent batch they see (see the module): `update(seqs)` once per step
    with the step's sampling rows, then `apply(logits, processors)` for `non_argmax_invariant` (before penalties and
    sampling) and `argmax_invariant` ones (after temperature and min-p, in steps that sample); `release(seq_ids)`
    forgets finished sequences."""

    def __init__(self, processors: list[LogitsProcessor], device: torch.device):
        self.processors = processors
        self.argmax_invariant = [p for p in processors if p.is_argmax_invariant()]
        self.non_argmax_invariant = [p for p in processors if not p.is_argmax_invariant()]
        self.device = device
        self.slots: list[int | None] = []  # batch index -> sequence id (None: free)
        self.index: dict[int, int] = {}  # sequence id -> batch index
        self.tokens: dict[int, tuple[list[int], list[int]]] = {}  # sequence id -> (prompt token ids, output list)
        self.order: torch.Tensor | None = None  # index i's row of the step's logits (None: row i)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget the token lists of finished or aborted sequences (they leave the batch in the next step)."""
        for seq_id in seq_ids:
            self.tokens.pop(seq_id, None)

    def update(self, seqs: Sequence) -> None:
        """The step's sampling rows (`SamplingRow`s, one per sequence) become the batch: tell every processor how
        it changed (`update_state`: a `BatchUpdate`, or None), and note where each index's row is."""
        rows = {seq.seq_id: row for row, seq in enumerate(seqs)}
        if len(rows) != len(seqs):
            raise RuntimeError("custom logits processors see one row per sequence and step (no speculative decoding)")
        removed = [self.index.pop(seq_id) for seq_id in list(self.index) if seq_id not in rows]
        for i in removed:
            self.slots[i] = None
        free = sorted(removed)  # a heap: the lowest free index first
        added: list[AddedRequest] = []
        for seq in seqs:
            prompt, output = self._token_lists(seq)
            if seq.seq_id in self.index:
                continue
            if free:
                i = heapq.heappop(free)
                self.slots[i] = seq.seq_id
            else:
                i = len(self.slots)
                self.slots.append(seq.seq_id)
            self.index[seq.seq_id] = i
            added.append((i, seq.params, prompt, output))
        moved = self._condense(free)
        reused = {i for i, *_ in added}
        removed = sorted((i for i in removed if i not in reused), reverse=True)  # a reused index: the add replaces
        update = BatchUpdate(len(seqs), removed, added, moved) if removed or added or moved else None
        order = [rows[seq_id] for seq_id in self.slots]
        self.order = None if order == list(range(len(order))) else to_device(order, torch.int64, self.device)
        for processor in self.processors:
            processor.update_state(update)

    def _token_lists(self, seq) -> tuple[list[int], list[int]]:
        """`seq`'s prompt token ids and its output token list (the same list every step), brought up to its tokens."""
        n = seq.num_prompt_tokens
        if seq.seq_id not in self.tokens:
            self.tokens[seq.seq_id] = (seq.token_ids[:n], [])
        prompt, output = self.tokens[seq.seq_id]
        done = len(seq.token_ids) - n
        if len(output) < done:
            output += seq.token_ids[n + len(output):]
        elif len(output) > done:
            del output[done:]
        return prompt, output

    def _condense(self, free: list[int]) -> list[MovedRequest]:
        """Fill the free indices below the last sequence's with the last sequences (as vLLM's input batch condenses),
        so the batch's indices are 0 to its size - 1."""
        moved: list[MovedRequest] = []
        while True:
            while self.slots and self.slots[-1] is None:
                self.slots.pop()
            if not free or free[0] >= len(self.slots):
                return moved
            hole, last = heapq.heappop(free), len(self.slots) - 1
            seq_id = self.slots.pop()
            self.slots[hole] = seq_id
            self.index[seq_id] = hole
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))

    def apply(self, logits: torch.Tensor, processors: list[LogitsProcessor], shared: bool) -> torch.Tensor:
        """`logits` (the step's rows, in its order) through `processors`, which see them in index order. `shared`:
        `logits` is read again later, so processors (which may write in place) get a copy."""
        if self.order is None:
            rows = logits.clone() if shared else logits
        else:
            rows = logits.index_select(0, self.order)
        for processor in processors:
            rows = processor.apply(rows)
        return rows if self.order is None else logits.index_copy(0, self.order, rows)
