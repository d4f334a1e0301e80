import torch
from torch import nn

from nanovllm.backends import TORCH
from nanovllm.backends.context import get_context


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over the cache (see `Context`).

    The model runner assigns `backend` (a `nanovllm.backends.Backend`), and the cache through
    `nanovllm.execution.kv_cache.bind_kv_cache`.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = TORCH

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return self.backend.attend(q, self.k_cache, self.v_cache, ctx, self.scale)
