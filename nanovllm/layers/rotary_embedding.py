"""Rotary position embedding and the rope scalings of transformers' `ROPE_INIT_FUNCTIONS`.

Each scaling computes the inverse frequencies with the same float32 operations, in the same order, as transformers'
`_compute_*_parameters`, so that the cos/sin tables are bitwise transformers' (the tests compare greedy tokens).
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels.fused import fused_op


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@dataclass(frozen=True)
class LinearRopeScaling:
    """Positions divided by `factor` (position interpolation), done on the frequencies."""

    factor: float
    attention_factor = 1.0

    def inv_freq(self, base: float, dim: int) -> torch.Tensor:
        return default_inv_freq(base, dim) / self.factor


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    attention_factor = 1.0

    def inv_freq(self, base: float, dim: int) -> torch.Tensor:
        return self.apply(default_inv_freq(base, dim))

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


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (`beta_fast`..`beta_slow`
    rotations over the original context), and cos/sin scaled by `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def inv_freq(self, base: float, dim: int) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation_factor = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor


@dataclass(frozen=True)
class DynamicNtkScaling:
    """Dynamic NTK: transformers rescales the base only for sequences longer than `max_position_embeddings`, which
    nanovllm never runs (max_model_len is capped there); below it the frequencies are its init-time ones."""

    factor: float
    max_position_embeddings: int
    attention_factor = 1.0

    def inv_freq(self, base: float, dim: int) -> torch.Tensor:
        seq_len = self.max_position_embeddings
        base = base * ((self.factor * seq_len / self.max_position_embeddings) - (self.factor - 1)) ** (dim / (dim - 2))
        return default_inv_freq(base, dim)


@dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3's LongRoPE: per-frequency divisors, `short_factor` for sequences within the original context and
    `long_factor` beyond it, and cos/sin scaled by `attention_factor`.

    transformers picks the set per forward call from the longest position it sees, so a token computed in a prompt
    of length L uses the long set iff L > original, and a generated token at position p iff p + 1 > original: the
    `lengths` `RotaryEmbedding` takes (`Context.rope_lengths`).
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    def inv_freq(self, base: float, dim: int, long: bool = False) -> torch.Tensor:
        factors = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float32)
        return 1.0 / (factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


RopeScaling = LinearRopeScaling | Llama3RopeScaling | YarnRopeScaling | DynamicNtkScaling | LongRopeScaling


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@fused_op(cpu_kernel="apply_rotary")
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half (NeoX) layout, with a precomputed float32 cos/sin table.

    With `rotary_dim < head_dim` (partial rotary) only the first `rotary_dim` features of each head turn. With
    LongRoPE the table holds the short set's rows then the long set's, and a token reads the long ones when the
    length it was computed at (`lengths`; for a generated token, its position + 1) exceeds the original context.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: RopeScaling | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim = rotary_dim or head_dim
        self.partial = rotary_dim < head_dim
        self.max_position = max_position
        self.long_after = 0
        if scaling is None:
            table = self._table(default_inv_freq(base, rotary_dim), max_position, 1.0)
        elif isinstance(scaling, LongRopeScaling):
            self.long_after = scaling.original_max_position_embeddings
            table = torch.cat([self._table(scaling.inv_freq(base, rotary_dim, long), max_position,
                                           scaling.attention_factor) for long in (False, True)])
        else:
            table = self._table(scaling.inv_freq(base, rotary_dim), max_position, scaling.attention_factor)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    @staticmethod
    def _table(inv_freq: torch.Tensor, max_position: int, attention_factor: float) -> torch.Tensor:
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        return torch.cat((cos, sin), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                lengths: torch.Tensor | None = None):
        """q `[tokens, heads, head_dim]`, k `[tokens, kv_heads, head_dim]`; `lengths` (LongRoPE only): per token,
        the sequence length transformers computed it at (default: position + 1)."""
        if self.long_after:
            lengths = positions + 1 if lengths is None else lengths
            positions = positions + (lengths > self.long_after).long() * self.max_position
        if not self.partial:
            return apply_rotary(positions, q, k, self.cos_sin_cache)
        d = self.rotary_dim
        q_rot, k_rot = apply_rotary(positions, q[..., :d], k[..., :d], self.cos_sin_cache)
        return torch.cat((q_rot, q[..., d:]), -1), torch.cat((k_rot, k[..., d:]), -1)
