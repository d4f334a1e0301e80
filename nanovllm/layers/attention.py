import torch
from torch import nn

from nanovllm.kernels.attention import TORCH
from nanovllm.kernels.attention.context import get_context


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over the cache (see `Context`).

    The model runner assigns `backend` (a `nanovllm.kernels.attention.Backend`), and the cache through
    `nanovllm.execution.kv_cache.bind_kv_cache`. `sliding_window` > 0: a query sees only the last that many
    positions (itself included); `softcap` > 0: scores are capped by `softcap * tanh(score / softcap)`.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, sliding_window: int = 0,
                 softcap: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = TORCH

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return self.backend.attend(q, self.k_cache, self.v_cache, ctx, self.scale, window=self.sliding_window,
                                   softcap=self.softcap)
