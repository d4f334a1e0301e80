"""The step's grammar mask applied to the logits: one vectorized operation for every constrained row."""
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

_BITS = torch.tensor([1 << bit for bit in range(31)] + [-(1 << 31)], dtype=torch.int32)
_bits_on: dict[torch.device, torch.Tensor] = {}


@dataclass
class TokenBitmask:
    """Which tokens the constrained rows may sample: `bitmask[j]` (int32 words, on the host; bit b of word w allows
    token 32w + b) for sampling row `rows[j]`, once `filling` (the grammar backend at work while the model runs) is
    done."""

    rows: list[int]
    bitmask: torch.Tensor
    filling: Future | None = None

    def words(self) -> torch.Tensor:
        if self.filling is not None:
            self.filling.result()
        return self.bitmask


def allowed_tokens(mask: TokenBitmask, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The mask as booleans `[rows, vocab_size]` on `device`: unpacked by numpy on the host for the CPU (a C loop,
    ~10x faster than torch's shifts there), by torch on the device otherwise (only the bitmask crosses the bus).
    Words are read in the host's byte order, little-endian, as the grammar backends write them."""
    if device.type == "cpu":
        bits = np.unpackbits(mask.words().numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))[:, :vocab_size]
    if device not in _bits_on:
        _bits_on[device] = _BITS.to(device)
    words = mask.words().to(device, non_blocking=True)
    return ((words.unsqueeze(-1) & _bits_on[device]) != 0).flatten(1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """`logits` with every token the mask does not allow at -inf (a new tensor; `logits` is unchanged)."""
    allowed = allowed_tokens(mask, logits.size(1), logits.device)
    if len(mask.rows) == logits.size(0):
        return torch.where(allowed, logits, float("-inf"))
    index = torch.tensor(mask.rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    return logits.index_put((index,), torch.where(allowed, logits[index], float("-inf")))
