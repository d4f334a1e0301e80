import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.process_group import tp_rank_and_size
from nanovllm.kernels.fused import fused_op


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return _rms_norm(x, weight, eps), x


rms_norm = fused_op(_rms_norm, cpu_kernel="rms_norm")
add_rms_norm = fused_op(_add_rms_norm, cpu_kernel="add_rms_norm")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual`, adds it first and returns the new residual too.

    `weight_offset` is added to the checkpoint's weight when it is loaded: Gemma stores `w` and scales by `1 + w`
    (the same product in float32; in half precision `1 + w` is rounded once, at load).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        if weight_offset:
            self.weight.weight_loader = lambda param, loaded: param.data.copy_(loaded.float() + weight_offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with a bias (GPT-NeoX, StableLM), with RMSNorm's interface: with `residual`, adds it first and
    returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        x = x + residual
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps), x


class HeadLayerNorm(nn.Module):
    """A LayerNorm without bias over each head's features, each head with its own weight (StableLM's
    `qk_layernorm`): input `[tokens, heads, head_dim]`, weight `[heads, head_dim]`, this rank's heads of it."""

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.tp_rank, tp_size = tp_rank_and_size()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_heads // tp_size, head_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.tp_rank * param.size(0), param.size(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features split across the tensor-parallel ranks (OLMo 2's norm over all query or key heads):
    each rank holds its slice of the features and of the weight, and the sum of squares is all-reduced. One rank:
    `RMSNorm`'s computation."""

    def __init__(self, full_size: int, eps: float = 1e-6):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.full_size, self.eps = full_size, eps
        self.weight = nn.Parameter(torch.ones(full_size // self.tp_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.tp_rank * param.size(0), param.size(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return rms_norm(x, self.weight, self.eps)
        dtype, x = x.dtype, x.float()
        squares = x.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares)
        return self.weight * (x * torch.rsqrt(squares / self.full_size + self.eps)).to(dtype)
