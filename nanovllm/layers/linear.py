"""Linear layers, replicated or sharded over the tensor-parallel group.

Each parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that copies this
rank's slice of a full checkpoint tensor into it. A weight given as GGML blocks (`GGMLTensor`: a GGUF tensor, or one
quantized at load) is sliced the same way and kept aside in `ggml_parts`; `nanovllm.models.loader` then makes the
layer's weight of them (`GGMLWeight`).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.process_group import tp_rank_and_size
from nanovllm.layers.ggml_weight import GGMLTensor, GGMLWeight
from nanovllm.layers.lora import LoRALayer


def linear(x: torch.Tensor, weight: torch.Tensor | GGMLWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through oneDNN when the weight was prepacked (see `nanovllm.layers.prepack`), or over GGML
    blocks."""
    if isinstance(weight, GGMLWeight):
        return weight.linear(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor | GGMLWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.gelu(linear(x, weight, bias))` (erf's GELU), in the product's own oneDNN call when the weight was prepacked:
    applied to the float32 sums before they are rounded to x's dtype, with no pass over the output of its own (an
    encoder's intermediate layer, the MLP's widest output)."""
    if isinstance(weight, torch.Tensor) and weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], "none")
    return F.gelu(linear(x, weight, bias))


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int | None = None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.ggml_parts: list[tuple[int, GGMLTensor]] = []  # (first row, rows) of a weight given as GGML blocks
        self.lora: LoRALayer | None = None  # LoRA adapters added to the output (`nanovllm.layers.lora`)

    def store(self, param: nn.Parameter, offset: int, rows: torch.Tensor | GGMLTensor) -> None:
        """Put `rows` at row `offset` of `param`; GGML rows go to `ggml_parts`."""
        if isinstance(rows, GGMLTensor):
            self.ggml_parts.append((offset, rows))
        else:
            param.data.narrow(0, offset, rows.size(0)).copy_(rows)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | GGMLTensor) -> None:
        split = self.tp_dim is not None and param.dim() > self.tp_dim
        expected = tuple(n * self.tp_size if split and i == self.tp_dim else n for i, n in enumerate(param.shape))
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"it has shape {tuple(loaded_weight.shape)}, but the model config implies {expected}; "
                             "the checkpoint and its config do not match")
        if split and self.tp_size > 1:
            shard = param.size(self.tp_dim)
            loaded_weight = loaded_weight.narrow(self.tp_dim, self.tp_rank * shard, shard)
        self.store(param, 0, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add_to(x, y)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (e.g. a mixture-of-experts router)."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank holds `output_size / tp_size` rows."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        _, tp_size = tp_rank_and_size()
        super().__init__(input_size, output_size // tp_size, bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | GGMLTensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        self.store(param, offset, loaded_weight.chunk(self.tp_size, 0)[self.tp_rank])


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split over heads: each rank owns whole query and KV heads."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        _, tp_size = tp_rank_and_size()
        self.head_size = head_size
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = total_num_kv_heads // tp_size
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | GGMLTensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset = {"q": 0, "k": q_size, "v": q_size + kv_size}[shard_id]
        self.store(param, offset, loaded_weight.chunk(self.tp_size, 0)[self.tp_rank])


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce (left to the caller with
    `reduce_results=False`, which then sums them with others in one)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        _, tp_size = tp_rank_and_size()
        super().__init__(input_size // tp_size, output_size, bias, tp_dim=1)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.lora is not None:
            y = self.lora.add_to(x, y)
        if self.tp_size > 1 and self.reduce_results:
            dist.all_reduce(y)
        return y
