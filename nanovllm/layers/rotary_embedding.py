import math
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.fused import fused_op


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Same float32 operations, in the same order, as transformers' `_compute_llama3_parameters`."""
        old_len = self.original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = old_len / self.low_freq_factor, old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@fused_op(cpu_kernel="apply_rotary")
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half (NeoX) layout, with a precomputed float32 cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: Llama3RopeScaling | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            inv_freq = scaling.apply(inv_freq)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q `[tokens, heads, head_dim]`, k `[tokens, kv_heads, head_dim]`."""
        return apply_rotary(positions, q, k, self.cos_sin_cache)
