"""The step's grammar mask applied to the logits: one vectorized operation for every constrained row."""
from dataclasses import dataclass

import torch

_BITS = torch.tensor([1 << bit for bit in range(31)] + [-(1 << 31)], dtype=torch.int32)
_bits_on: dict[torch.device, torch.Tensor] = {}


@dataclass
class TokenBitmask:
    """Which tokens the constrained rows may sample: `bitmask[j]` (int32 words; bit b of word w allows token
    32w + b) for sampling row `rows[j]`."""

    rows: list[int]
    bitmask: torch.Tensor


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """`logits` with every token the mask does not allow at -inf (a new tensor; `logits` is unchanged)."""
    device = logits.device
    if device not in _bits_on:
        _bits_on[device] = _BITS.to(device)
    words = mask.bitmask.to(device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) & _bits_on[device]) != 0).flatten(1)[:, :logits.size(1)]
    if len(mask.rows) == logits.size(0):
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(mask.rows, dtype=torch.int64).to(device, non_blocking=True)
    return logits.index_put((index,), logits[index].masked_fill(~allowed, float("-inf")))
