import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.fused import fused_op

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
"""Hugging Face `hidden_act` names the MLPs implement: SiLU, exact GELU, GELU's tanh approximation."""


@fused_op(cpu_kernel="silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


@fused_op
def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.gelu(gate, approximate="tanh") * up


@fused_op
def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.gelu(gate) * up


_GATED = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}
_PLAIN = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class ActAndMul(nn.Module):
    """act(gate) * up for an input laid out as [gate | up] along the last dim (`act` one of `ACTIVATIONS`)."""

    def __init__(self, act: str):
        super().__init__()
        self.fn = _GATED[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Activation(nn.Module):
    """A plain (ungated) activation, one of `ACTIVATIONS`."""

    def __init__(self, act: str):
        super().__init__()
        self.fn = _PLAIN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
