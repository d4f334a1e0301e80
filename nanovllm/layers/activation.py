import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.fused import fused_op


@fused_op(cpu_kernel="silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up for an input laid out as [gate | up] along the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
