"""CPU weight prepacking: lay every linear weight out once in oneDNN's blocked format.

MKL's sgemm re-packs the weight matrix on every call. At decode batch sizes (a few to a few
dozen rows) that repacking costs more than the product itself, so prepacked projections run
several times faster there, and large prefill batches no slower (README, Benchmark). This is
the same transformation inductor's CPU `freezing` applies, without compiling the model.

The LM head is packed too. When it is tied to the embedding it gets its own packed copy (the
embedding lookup needs the plain matrix), which costs `vocab x hidden` more memory.
"""
import torch
from torch import nn

from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.linear import LinearBase


def can_prepack(dtype: torch.dtype) -> bool:
    return torch.backends.mkldnn.is_available() and dtype == torch.float32


@torch.no_grad()
def prepack_linear_weights(model: nn.Module) -> None:
    """Replace the weight of every linear layer and LM head by its oneDNN-packed form (CPU, float32)."""
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)) and not module.weight.is_mkldnn:
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
            module.weight = nn.Parameter(packed, requires_grad=False)
