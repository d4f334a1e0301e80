"""Where a PEFT adapter's projections land in nanovllm's decoder: q/k/v are slices of the fused `qkv_proj`, gate/up of
`gate_up_proj` (each slice with its own A and B), and a fused `qkv_proj` / `gate_up_proj` (Phi-3's, GPT-NeoX's
`query_key_value`: single modules in PEFT) covers its whole fused layer (one A, B split into its q/k/v or gate/up
rows); an ungated MLP's input projection (GPT-NeoX's `dense_h_to_4h`) is `fc_in`. Under tensor parallelism each
rank keeps its share, as vLLM shards LoRA."""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.ggml_weight import GGMLWeight
from nanovllm.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.lora import LoRALayer, LoRASlice, LoRAWeights
from nanovllm.lora.peft import PeftAdapter

LAYERS = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "fc_in", "down_proj")}
PROJECTIONS = {"q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"),
               "v_proj": ("self_attn", "qkv_proj"), "qkv_proj": ("self_attn", "qkv_proj"),
               "o_proj": ("self_attn", "o_proj"), "gate_proj": ("mlp", "gate_up_proj"),
               "up_proj": ("mlp", "gate_up_proj"), "gate_up_proj": ("mlp", "gate_up_proj"), "fc_in": ("mlp", "fc_in"),
               "down_proj": ("mlp", "down_proj")}


def attach_lora_layers(model: nn.Module, kernel: bool) -> dict[tuple[int, str, str], LoRALayer]:
    """Give every decoder layer's projections (those the model has: a mixture of experts has no dense MLP) a
    `LoRALayer` (`kernel`: adding its deltas with the CPU kernel); returns them by (layer, block, nanovllm's
    projection name)."""
    found = {}
    for index, layer in enumerate(model.model.layers):
        for block, names in LAYERS.items():
            for name in names:
                linear = getattr(getattr(layer, block, None), name, None)
                if isinstance(linear, LinearBase):
                    out_features, in_features = _shape(linear)
                    slices = 3 if isinstance(linear, QKVParallelLinear) else len(getattr(linear, "output_sizes", [0]))
                    linear.lora = LoRALayer(in_features, out_features, kernel, slices)
                    found[index, block, name] = linear.lora
    return found


def _shape(linear: LinearBase) -> tuple[int, int]:
    """(out, in) features of the layer's weight, whether float, prepacked or GGML blocks."""
    weight = linear.weight
    if isinstance(weight, GGMLWeight):
        return sum(getattr(weight, f"segment{i}").size(0) for i in range(len(weight.qtypes))), weight.in_features
    return tuple(weight.shape)


@dataclass(frozen=True)
class Target:
    """Where a PEFT projection lands on this rank: the LoRALayer; the features PEFT's A and B must have; A's input
    columns this rank keeps (all, unless the layer is row-parallel); and its parts, each (the B rows this rank keeps,
    their first output column on this rank): a column-parallel layer's B rows are split over the ranks as its output
    is."""

    lora: LoRALayer
    in_total: int
    out_total: int
    in_columns: tuple[int, int]
    parts: tuple[tuple[tuple[int, int], int], ...]


def _target(linear_layers: dict, model: nn.Module, layer: int, name: str, rank: int, size: int) -> Target | None:
    """Where projection `name` of decoder layer `layer` lands on tensor-parallel rank `rank` of `size`; None when the
    model has no such projection."""
    if name not in PROJECTIONS or layer >= len(model.model.layers):
        return None
    block, fused = PROJECTIONS[name]
    lora = linear_layers.get((layer, block, fused))
    if lora is None:
        return None
    module = getattr(getattr(model.model.layers[layer], block), fused)
    if isinstance(module, RowParallelLinear):
        width, out = lora.in_features, lora.out_features
        return Target(lora, width * size, out, (rank * width, (rank + 1) * width), (((0, out), 0),))
    whole = (0, lora.in_features)
    if isinstance(module, QKVParallelLinear):
        q, kv = module.num_heads * module.head_size, module.num_kv_heads * module.head_size
        shards = {"q_proj": [(q, 0)], "k_proj": [(kv, q)], "v_proj": [(kv, q + kv)],
                  "qkv_proj": [(q, 0), (kv, q), (kv, q + kv)]}[name]
    else:
        half = lora.out_features // 2
        shards = {"gate_proj": [(half, 0)], "up_proj": [(half, half)],
                  "gate_up_proj": [(half, 0), (half, half)]}.get(name, [(lora.out_features, 0)])
    parts, first = [], 0
    for local, offset in shards:
        parts.append(((first + rank * local, first + (rank + 1) * local), offset))
        first += local * size
    return Target(lora, lora.in_features, first, whole, tuple(parts))


def adapter_weights(adapter: PeftAdapter, model: nn.Module, linear_layers: dict, label: str, max_rank: int,
                    dtype: torch.dtype, device: torch.device, tp_rank: int = 0,
                    tp_size: int = 1) -> dict[LoRALayer, LoRAWeights]:
    """`adapter`'s weights per LoRALayer of `model`, this tensor-parallel rank's share (as vLLM shards them: a
    column-parallel layer's B rows split as its output, a row-parallel layer's A columns as its input, whose partial
    deltas the layer's all-reduce sums), in the model's dtype on its device; a ValueError naming the adapter when a
    rank is above `max_rank` or a projection is absent from the model or shaped for another one."""
    if adapter.rank > max_rank:
        raise ValueError(f"LoRA adapter {label} has rank {adapter.rank}, above max_lora_rank={max_rank}: start the "
                         f"LLM with max_lora_rank={adapter.rank} or more")
    per_layer: dict[LoRALayer, list] = {}
    for module in adapter.modules:
        where = f"model.layers.{module.layer}.{module.name}"
        target = _target(linear_layers, model, module.layer, module.name, tp_rank, tp_size)
        if target is None:
            raise ValueError(f"LoRA adapter {label} adapts {where}, which this model does not have (LoRA runs on the "
                             f"decoder layers' {', '.join(PROJECTIONS)} where the model has them)")
        if tuple(module.a.shape) != (module.rank, target.in_total) or module.b.size(0) != target.out_total:
            raise ValueError(f"LoRA adapter {label}: {where} has lora_A {tuple(module.a.shape)} and lora_B "
                             f"{tuple(module.b.shape)}, but this model's projection maps {target.in_total} to "
                             f"{target.out_total} features: the adapter was trained for another base model")
        per_layer.setdefault(target.lora, []).append((target, module))
    weights = {}
    for lora, modules in per_layer.items():
        a, slices, ranks = [], [], 0
        for target, module in modules:
            a.append(module.a[:, target.in_columns[0]:target.in_columns[1]])
            for (first, end), offset in target.parts:
                b = module.b[first:end].to(device=device, dtype=dtype).contiguous()
                slices.append(LoRASlice(offset, end - first, b, ranks, ranks + module.rank, module.scale))
            ranks += module.rank
        weights[lora] = LoRAWeights(torch.cat(a).to(device=device, dtype=dtype).contiguous(), slices)
    return weights
