"""One step's inputs on the device: each sequence's chunk of tokens packed into the model's input ids and positions,
and the attention context every layer reads (`nanovllm.kernels.attention.context`). The target model's steps and a
draft model's forwards are packed the same way."""
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
    input_ids, positions, slot_mapping, context_lens, cu_seqlens_q, cu_seqlens_k = [], [], [], [], [0], [0]
    width = 0
    for seq, start, tokens in chunks:
        end = start + len(tokens)
        input_ids += tokens
        positions += range(start, end)
        slot_mapping += cache_slots(seq.block_table, block_size, start, end)
        context_lens.append(end)
        cu_seqlens_q.append(cu_seqlens_q[-1] + len(tokens))
        cu_seqlens_k.append(cu_seqlens_k[-1] + end)
        width = max(width, len(seq.block_table))
    block_tables = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq, _, _ in chunks]
    set_context(cu_seqlens_q=to_device(cu_seqlens_q, torch.int32, device),
                cu_seqlens_k=to_device(cu_seqlens_k, torch.int32, device),
                max_seqlen_q=max(b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])), max_seqlen_k=max(context_lens),
                context_lens=to_device(context_lens, torch.int32, device),
                block_tables=to_device(block_tables, torch.int32, device),
                slot_mapping=to_device(slot_mapping, torch.int64, device),
                logits_indices=to_device(logits_indices, torch.int64, device),
                rope_lengths=None if rope_lengths is None else to_device(rope_lengths, torch.int64, device))
    return to_device(input_ids, torch.int64, device), to_device(positions, torch.int64, device)
