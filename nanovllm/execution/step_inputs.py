"""One step's inputs on the device: each sequence's chunk of tokens packed into the model's input ids and positions,
and the attention context every layer reads (`nanovllm.kernels.attention.context`). The target model's steps and a
draft model's forwards are packed the same way."""
from itertools import accumulate
from typing import NamedTuple

import torch

from nanovllm.core.sequence import Sequence
from nanovllm.kernels.attention.context import set_context


class Chunk(NamedTuple):
    """`tokens` of `seq` at positions `start`, `start + 1`, ...; the tokens before are in its KV cache."""

    seq: Sequence
    start: int
    tokens: list[int]


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; on CUDA through pinned memory, so the copy does not block the host."""
    return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def cache_slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat cache slots of token positions `start..end-1` of a sequence with this block table."""
    slots = []
    for i in range(start // block_size, (end + block_size - 1) // block_size):
        first = block_table[i] * block_size
        slots.extend(range(first + max(start - i * block_size, 0), first + min(end - i * block_size, block_size)))
    return slots


def set_step_context(chunks: list[Chunk], block_size: int, device: torch.device, logits_indices: list[int],
                     rope_lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Set the attention context of one varlen step over `chunks` (their K/V written to their blocks' slots, logits
    taken at rows `logits_indices`; `rope_lengths`: see `Context`) and return its input ids and positions."""
    input_ids, positions, slot_mapping, context_lens = [], [], [], []
    for seq, start, tokens in chunks:
        end = start + len(tokens)
        input_ids += tokens
        positions += range(start, end)
        slot_mapping += cache_slots(seq.block_table, block_size, start, end)
        context_lens.append(end)
    width = max(len(chunk.seq.block_table) for chunk in chunks)

    def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, device)

    set_context(cu_seqlens_q=tensor(list(accumulate((len(c.tokens) for c in chunks), initial=0)), torch.int32),
                cu_seqlens_k=tensor(list(accumulate(context_lens, initial=0)), torch.int32),
                max_seqlen_q=max(len(c.tokens) for c in chunks), max_seqlen_k=max(context_lens),
                context_lens=tensor(context_lens, torch.int32),
                block_tables=tensor([c.seq.block_table + [-1] * (width - len(c.seq.block_table)) for c in chunks],
                                    torch.int32),
                slot_mapping=tensor(slot_mapping, torch.int64), logits_indices=tensor(logits_indices, torch.int64),
                rope_lengths=None if rope_lengths is None else tensor(rope_lengths, torch.int64))
    return tensor(input_ids, torch.int64), tensor(positions, torch.int64)
