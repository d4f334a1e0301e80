"""CUDA-graph decode: one captured graph per padded batch size, replayed with the batch copied into static buffers;
and what a step that verifies drafts, which no graph replays, costs against one that replays a graph.

The bucketing, padding and pricing below are plain code, so they are unit-tested on CPU; only `DecodeGraphs` needs a
GPU.
"""
import bisect
import math
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.execution.stopwatch import SizeClassRatios
from nanovllm.kernels.attention.context import Context, reset_context, set_context

MAX_GRAPH_BATCH_SIZE = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, up to and including min(max_num_seqs, 512)."""
    cap = min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)
    sizes = [size for size in (1, 2, 4, 8) if size < cap] + list(range(16, cap, 16))
    return sizes + [cap]


def pick_batch_size(sizes: list[int], batch_size: int) -> int | None:
    """The smallest captured size that holds `batch_size` (sizes ascending), or None when none does."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """Static decode inputs and outputs that the graphs read and write, sized for the largest graph."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    hidden_states: torch.Tensor
    max_seqlen_k: int

    @classmethod
    def allocate(cls, max_batch_size: int, max_blocks_per_seq: int, max_seqlen_k: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device) -> "DecodeBuffers":
        def full(*shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(input_ids=full(max_batch_size, value=0, dtype=torch.int64),
                   positions=full(max_batch_size, value=0, dtype=torch.int64),
                   cu_seqlens_q=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device),
                   slot_mapping=full(max_batch_size, value=-1, dtype=torch.int64),
                   context_lens=full(max_batch_size, value=0, dtype=torch.int32),
                   block_tables=full(max_batch_size, max_blocks_per_seq, value=-1, dtype=torch.int32),
                   hidden_states=full(max_batch_size, hidden_size, value=0, dtype=dtype),
                   max_seqlen_k=max_seqlen_k)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> None:
        """Copy one decode batch into the first rows. Every other row becomes padding that writes no
        K/V (slot -1) and attends to nothing (context length 0, block table all -1)."""
        n, width = input_ids.size(0), ctx.block_tables.size(1)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n] = ctx.slot_mapping
        self.context_lens.zero_()
        self.context_lens[:n] = ctx.context_lens
        self.block_tables.fill_(-1)
        self.block_tables[:n, :width] = ctx.block_tables

    def set_context(self, batch_size: int) -> None:
        """Point the attention context at the first `batch_size` rows of the buffers. `max_seqlen_k` is the
        longest context any replay may see, so that a kernel sized from it stays valid for every replay."""
        set_context(cu_seqlens_q=self.cu_seqlens_q[:batch_size + 1], max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k,
                    context_lens=self.context_lens[:batch_size], block_tables=self.block_tables[:batch_size],
                    slot_mapping=self.slot_mapping[:batch_size])

    def forward(self, model: nn.Module, batch_size: int) -> None:
        """The decode forward over the first `batch_size` rows, into `hidden_states`: what a graph captures."""
        self.set_context(batch_size)
        self.hidden_states[:batch_size] = model(self.input_ids[:batch_size], self.positions[:batch_size])


class DecodeGraphs:
    """The model's decode forward (without the LM head) captured once per padded batch size.

    Graphs are captured largest first and share one memory pool: they never run concurrently,
    so the smaller ones reuse the largest one's intermediates. The KV cache must already be
    allocated, since the graphs bake in its addresses.
    """

    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, max_seqlen_k: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks_per_seq, max_seqlen_k, hidden_size, dtype,
                                              device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        b, pool = self.buffers, None
        try:
            for size in reversed(self.sizes):
                b.forward(self.model, size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    b.forward(self.model, size)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
                torch.cuda.synchronize()
        finally:
            reset_context()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Hidden states of one decode step, shape `[batch, hidden]`; the batch must fit (see `fits`)."""
        n = input_ids.size(0)
        self.buffers.load(input_ids, positions, ctx)
        self.graphs[pick_batch_size(self.sizes, n)].replay()
        return self.buffers.hidden_states[:n]


def verifies(batch: ScheduledBatch) -> bool:
    """Whether `batch` is a decode step but for drafts: each sequence computes its last token and its drafts."""
    return any(batch.drafts) and all(n == 1 + len(drafts) for n, drafts in zip(batch.num_tokens, batch.drafts))


class VerifyPrice:
    """What a step verifying drafts costs, in decode steps of the same batch, where decode replays CUDA graphs: the
    graphs hold one query row per sequence, so a verify step runs eagerly, launch by launch, which at small batch can
    cost several replays while the cost model of the adaptive draft count (`STEP_COST`) prices a row as nearly free.
    Measured on the device (`Stopwatch`: CUDA events) per size class of the batch: the replays' time (a moving
    average), each eager verify step's against it (`SizeClassRatios`; prior 1, so that every size speculates once)."""

    def __init__(self, max_graph_batch: int):
        self.max_graph_batch = max_graph_batch
        self.replay_seconds: dict[int, float] = {}
        self.ratios = SizeClassRatios(prior=1.0)

    def observe(self, batch: ScheduledBatch, replayed: bool, seconds: float) -> None:
        """`batch` ran in `seconds`, replaying a graph or not."""
        size = len(batch).bit_length()
        if replayed:
            last = self.replay_seconds.get(size)
            self.replay_seconds[size] = seconds if last is None else 0.7 * last + 0.3 * seconds
        elif size in self.replay_seconds and len(batch) <= self.max_graph_batch and verifies(batch):
            self.ratios.observe(len(batch), seconds / self.replay_seconds[size])

    def __call__(self, running: list[Sequence]) -> float:
        """What the next step of `running` costs with drafts against without: 1 where it runs eagerly anyway (a
        prompt's chunk is left, or the batch is larger than every graph); infinite where no replay of its size class
        has been timed yet (its drafts wait a step, which replays a graph and is timed); else as measured."""
        if len(running) > self.max_graph_batch or any(len(seq) - seq.num_computed_tokens > 1 for seq in running):
            return 1.0
        if len(running).bit_length() not in self.replay_seconds:
            return math.inf
        return self.ratios(len(running))
