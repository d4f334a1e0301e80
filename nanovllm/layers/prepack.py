"""CPU weight prepacking: lay every linear weight out once in oneDNN's blocked format.

MKL's sgemm re-packs the weight matrix on every call. At decode batch sizes (a few to a few
dozen rows) that repacking costs more than the product itself, so prepacked projections run
several times faster there, and large prefill batches no slower (docs/design.md, layers/). This is
the same transformation inductor's CPU `freezing` applies, without compiling the model.

bfloat16 weights are packed too where oneDNN runs bfloat16 natively (AVX512-BF16, AMX): there the
packed product is the plain one's result, faster at decode sizes. Elsewhere bfloat16 stays on
`F.linear`.

The LM head is packed too. When it is tied to the embedding it gets its own packed copy (the
embedding lookup needs the plain matrix), which costs `vocab x hidden` more memory.

GGML weights are repacked in the same spirit (`repack_ggml_weights`), as llama.cpp's CPU backend repacks them: the
bytes of each tile of 16 (AVX-512) or 8 (AVX2) rows reordered into the order the kernels stream them, so that no call
unpacks them again. Same bytes, same memory, tied LM heads included (their embedding lookups read through the tiles).
"""
import torch
from torch import nn

from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.ggml_weight import GGMLWeight
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.moe import FusedMoE


def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), as oneDNN reports it."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_prepack(dtype: torch.dtype) -> bool:
    """Whether oneDNN takes linear weights of `dtype` on this CPU: float32 always, bfloat16 where it is native."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or dtype == torch.bfloat16 and native_bfloat16()


@torch.no_grad()
def prepack_linear_weights(model: nn.Module) -> None:
    """Replace the weight of every linear layer and LM head, and every expert's, by its oneDNN-packed form (CPU, see
    `can_prepack`); GGML weights stay as they are."""
    for module in list(model.modules()):
        if isinstance(module, (LinearBase, ParallelLMHead)) and isinstance(module.weight, nn.Parameter) \
                and not module.weight.is_mkldnn:
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
            module.weight = nn.Parameter(packed, requires_grad=False)
        elif isinstance(module, FusedMoE):
            module.prepack()


def repack_ggml_weights(model: nn.Module) -> None:
    """Repack the GGML weight of every linear layer and LM head for the CPU kernels (`GGMLWeight.repack`)."""
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)) and isinstance(module.weight, GGMLWeight):
            module.weight.repack()
