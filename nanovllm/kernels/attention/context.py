"""Per-step attention metadata, set by the model runner and read by every Attention layer."""
from dataclasses import dataclass

import torch


@dataclass
class Context:
    """One step's batch, in the single shape every attention backend takes.

    Queries are packed along dim 0: sequence i owns rows `cu_seqlens_q[i]:cu_seqlens_q[i + 1]`,
    which are the last positions of its first `context_lens[i]` tokens (bottom-right causal
    alignment). Keys and values are always read from the paged cache through `block_tables[i]`,
    after this step's K/V were written to `slot_mapping` (slot -1: write nothing). A prefill, a
    prefill over a cached prefix, a prefill chunk, a decode and any mix of them are all this one
    shape; a row with context length 0 pads a batch and attends to nothing. `cu_seqlens_k` is the
    prefix sum of `context_lens`, for kernels that take offsets instead of lengths.
    `logits_indices` are the query rows whose logits are needed (the last of each sequence that
    samples in this step; a prompt chunk that does not reach the prompt's end samples nothing).
    `rope_lengths`, set only for models whose rope depends on it (LongRoPE) and only when some row's differs from
    position + 1 (a prompt row before the prompt's last), gives per query row the sequence length transformers
    computes that token at: max(position + 1, prompt length). Captured decode graphs run only without it.
    """

    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = None
    rope_lengths: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query: what CUDA graphs capture and decode kernels serve."""
        return self.max_seqlen_q == 1


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(**fields) -> None:
    global _CONTEXT
    _CONTEXT = Context(**fields)


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()
