import torch
from torch import nn

from nanovllm.backends import TorchBackend
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over the cache (see `Context`).

    The model runner assigns `backend`, and the cache through `bind_kv_cache`.
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
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return self.backend.attend(q, self.k_cache, self.v_cache, ctx, self.scale)


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor | None) -> None:
    """Point the model's attention layers at `kv_cache` `[k/v, layer, block, offset, kv_heads, head_dim]`
    (layer i gets `kv_cache[:, i]`), or at no cache with None."""
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = (torch.tensor([]),) * 2 if kv_cache is None else kv_cache[:, i]
