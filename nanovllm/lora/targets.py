"""Where a PEFT adapter's projections land in nanovllm's decoder: q/k/v are slices of the fused `qkv_proj`, gate/up of
`gate_up_proj` (each slice with its own A and B), and Phi-3's fused `qkv_proj` / `gate_up_proj`, single modules in
PEFT, cover their whole fused layer."""
import torch
from torch import nn

from nanovllm.layers.ggml_weight import GGMLWeight
from nanovllm.layers.linear import LinearBase, QKVParallelLinear
from nanovllm.layers.lora import LoRALayer, LoRASlice, LoRAWeights
from nanovllm.lora.peft import PeftAdapter

LAYERS = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}
PROJECTIONS = {"q_proj": ("self_attn", "qkv_proj"), "k_proj": ("self_attn", "qkv_proj"),
               "v_proj": ("self_attn", "qkv_proj"), "qkv_proj": ("self_attn", "qkv_proj"),
               "o_proj": ("self_attn", "o_proj"), "gate_proj": ("mlp", "gate_up_proj"),
               "up_proj": ("mlp", "gate_up_proj"), "gate_up_proj": ("mlp", "gate_up_proj"),
               "down_proj": ("mlp", "down_proj")}


def attach_lora_layers(model: nn.Module, prepack: bool) -> dict[tuple[int, str, str], LoRALayer]:
    """Give every decoder layer's projections (those the model has: a mixture of experts has no dense MLP) a
    `LoRALayer` (`prepack`: its stacked adapters laid out for oneDNN); returns them by (layer, block, nanovllm's
    projection name)."""
    found = {}
    for index, layer in enumerate(model.model.layers):
        for block, names in LAYERS.items():
            for name in names:
                linear = getattr(getattr(layer, block, None), name, None)
                if isinstance(linear, LinearBase):
                    out_features, in_features = _shape(linear)
                    linear.lora = LoRALayer(in_features, out_features, prepack)
                    found[index, block, name] = linear.lora
    return found


def _shape(linear: LinearBase) -> tuple[int, int]:
    """(out, in) features of the layer's weight, whether float, prepacked or GGML blocks."""
    weight = linear.weight
    if isinstance(weight, GGMLWeight):
        return sum(getattr(weight, f"segment{i}").size(0) for i in range(len(weight.qtypes))), weight.in_features
    return tuple(weight.shape)


def _slice(linear_layers: dict, model: nn.Module, layer: int, name: str) -> tuple[LoRALayer, int, int] | None:
    """The LoRALayer a PEFT projection adds to, and the output columns it covers; None when the model has none."""
    if name not in PROJECTIONS:
        return None
    block, fused = PROJECTIONS[name]
    lora = linear_layers.get((layer, block, fused))
    if lora is None:
        return None
    module = getattr(getattr(model.model.layers[layer], block), fused)
    if isinstance(module, QKVParallelLinear) and name in ("q_proj", "k_proj", "v_proj"):
        q, kv = module.num_heads * module.head_size, module.num_kv_heads * module.head_size
        return lora, *{"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}[name]
    if name in ("gate_proj", "up_proj"):
        half = lora.out_features // 2
        return lora, 0 if name == "gate_proj" else half, half
    return lora, 0, lora.out_features


def adapter_weights(adapter: PeftAdapter, model: nn.Module, linear_layers: dict, label: str,
                    max_rank: int, dtype: torch.dtype, device: torch.device) -> dict[LoRALayer, LoRAWeights]:
    """`adapter`'s weights per LoRALayer of `model`, in the model's dtype on its device; a ValueError naming the
    adapter when a rank is above `max_rank` or a projection is absent from the model or shaped for another one."""
    if adapter.rank > max_rank:
        raise ValueError(f"LoRA adapter {label} has rank {adapter.rank}, above max_lora_rank={max_rank}: start the "
                         f"LLM with max_lora_rank={adapter.rank} or more")
    per_layer: dict[LoRALayer, list] = {}
    for module in adapter.modules:
        where = f"model.layers.{module.layer}.{module.name}"
        target = _slice(linear_layers, model, module.layer, module.name) \
            if module.layer < len(model.model.layers) else None
        if target is None:
            raise ValueError(f"LoRA adapter {label} adapts {where}, which this model does not have (LoRA runs on the "
                             f"decoder layers' {', '.join(PROJECTIONS)} where the model has them)")
        lora, offset, size = target
        if tuple(module.a.shape) != (module.rank, lora.in_features) or module.b.size(0) != size:
            raise ValueError(f"LoRA adapter {label}: {where} has lora_A {tuple(module.a.shape)} and lora_B "
                             f"{tuple(module.b.shape)}, but this model's projection maps {lora.in_features} to "
                             f"{size} features: the adapter was trained for another base model")
        per_layer.setdefault(lora, []).append((offset, size, module))
    weights = {}
    for lora, parts in per_layer.items():
        slices, ranks = [], 0
        for offset, size, module in parts:
            b = module.b.to(device=device, dtype=dtype).contiguous()
            slices.append(LoRASlice(offset, size, b, ranks, ranks + module.rank, module.scale))
            ranks += module.rank
        a = torch.cat([module.a for _, _, module in parts]).to(device=device, dtype=dtype).contiguous()
        weights[lora] = LoRAWeights(a, slices)
    return weights
