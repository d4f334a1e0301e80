import torch
from torch import nn

from nanovllm.utils.compile import fused_op


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@fused_op
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half (NeoX) layout, with a precomputed float32 cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q `[tokens, heads, head_dim]`, k `[tokens, kv_heads, head_dim]`."""
        return apply_rotary(positions, q, k, self.cos_sin_cache)
