import torch
from torch import nn

from nanovllm.backends import TorchBackend
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then runs the backend's prefill or decode.

    The model runner assigns `k_cache`, `v_cache` and `backend` once the cache is allocated.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = TorchBackend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if self.k_cache.numel():
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, ctx, self.scale)
        return self.backend.decode(q, self.k_cache, self.v_cache, ctx, self.scale)
