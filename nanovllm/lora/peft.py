"""A PEFT LoRA directory (`adapter_config.json` and `adapter_model.safetensors` or `.bin`) read into plain tensors: the
A and B matrix and the scale of every adapted projection, by decoder layer and projection under Llama's names.

PEFT names a module as the family's checkpoint does (GPT-NeoX's `gpt_neox.layers.N.attention.query_key_value`,
Phi-3's fused `qkv_proj`); its B goes through the base model's `checkpoint_weights`, as the checkpoint's weight does,
so its rows land where that weight's rows land (GPT-NeoX's per-head q/k/v regrouped) under Llama's names. A module
whose weight the checkpoint splits (q/k/v, gate/up) stays one module, `qkv_proj` or `gate_up_proj`: one A for all its
rows.

Which projections carry LoRA is read from the weights file, which holds exactly what PEFT made of `target_modules`
(names or a regex), `layers_to_transform` and `rank_pattern`; each one's scale is its `alpha_pattern` entry (else
`lora_alpha`) over its rank (its square root with `use_rslora`), as PEFT computes it. What nanovllm cannot run the
same way (DoRA, `modules_to_save`, LoRA biases, embedding or LM-head LoRA, Conv1D's `fan_in_fan_out`) is refused with a
ValueError naming the field.
"""
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$")
PROJECTION = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight$")  # under Llama's names
FUSED = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}
MIXTURE = {"experts", "shared_expert", "shared_expert_gate", "gate"}  # modules of a mixture of experts (Mixtral, Qwen)
CheckpointWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class LoRAModule:
    """One adapted projection: its delta is `scale * B @ A` (A: rank x in, B: out x rank)."""

    layer: int
    name: str  # the Hugging Face projection: q_proj, k_proj, v_proj, qkv_proj, o_proj, gate_proj, up_proj, ...
    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.size(0)


@dataclass
class PeftAdapter:
    """A PEFT LoRA adapter as read from `path`."""

    path: str
    modules: list[LoRAModule]

    @property
    def rank(self) -> int:
        return max(module.rank for module in self.modules)


def read_peft_adapter(path: str, label: str, checkpoint_weights: CheckpointWeights) -> PeftAdapter:
    """The adapter in the PEFT directory `path` (`label` names it in errors) for a base model whose
    `checkpoint_weights` maps its checkpoint's tensors to Llama's names and layout; a FileNotFoundError when the
    directory or its files are missing, a ValueError for what nanovllm cannot run."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"LoRA adapter {label}: no directory {path!r} (lora_path must be a local PEFT adapter "
                                "directory, with adapter_config.json and adapter_model.safetensors, or a llama.cpp "
                                "LoRA .gguf file)")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"LoRA adapter {label}: no adapter_config.json in {path!r}")
    with open(config_path) as f:
        config = json.load(f)
    _check_config(config, label)
    weights = _read_weights(path, label)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {label}: {key!r} is not a LoRA weight of a linear module "
                             "(<module>.lora_A.weight or <module>.lora_B.weight); embedding LoRA is not supported")
        module, which = match.groups()
        parts.setdefault(module, {})[which] = tensor
    modules = []
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {label}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.size(0) != b.size(1):
            raise ValueError(f"LoRA adapter {label}: {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, which do not make a LoRA pair")
        layer, name, b = _projection(module, b, checkpoint_weights, label)
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        rank = a.size(0)
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules.append(LoRAModule(layer, name, a, b, scale))
    if not modules:
        raise ValueError(f"LoRA adapter {label}: {path!r} holds no LoRA weights")
    return PeftAdapter(path, sorted(modules, key=lambda module: (module.layer, module.name)))


def _projection(module: str, b: torch.Tensor, checkpoint_weights: CheckpointWeights,
                label: str) -> tuple[int, str, torch.Tensor]:
    """The decoder layer, projection (Llama's name) and B rows in the model's order of PEFT's `module`, whose B's rows
    go through `checkpoint_weights` as its weight's rows do."""
    if MIXTURE & set(module.split(".")):
        raise ValueError(f"LoRA adapter {label}: {module} is part of a mixture of experts (its router, experts or "
                         "shared expert), which LoRA does not run on; adapt the attention projections (and dense "
                         "layers' MLPs) only")
    try:
        pieces = list(checkpoint_weights([(f"{module}.weight", b)]))
    except RuntimeError:
        raise ValueError(f"LoRA adapter {label}: {module} has lora_B {tuple(b.shape)}, whose rows do not split as "
                         "this model's weight does: the adapter was trained for another base model") from None
    found = [PROJECTION.match(name) for name, _ in pieces]
    if not pieces or None in found:
        raise ValueError(f"LoRA adapter {label}: {module} is not an attention or MLP projection of this model's "
                         "decoder layers; LoRA runs on those only (not on embeddings, the LM head or other modules), "
                         "for an adapter trained on this model's family")
    names = tuple(match.group(2) for match in found)
    return int(found[0].group(1)), names[0] if len(names) == 1 else FUSED[names], torch.cat([b for _, b in pieces])


def _check_config(config: dict, label: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {label}: peft_type is {config['peft_type']!r}; only LoRA adapters run")
    refused = {"use_dora": "DoRA (use_dora) is not supported: merge the adapter into the model instead",
               "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
               "lora_bias": "LoRA biases (lora_bias) are not supported",
               "fan_in_fan_out": "fan_in_fan_out (Conv1D layers, GPT-2 style) is not supported",
               "trainable_token_indices": "trainable_token_indices (embedding rows) is not supported",
               "target_parameters": "target_parameters (LoRA on parameters, not modules) is not supported",
               "layer_replication": "layer_replication is not supported"}
    for field, why in refused.items():
        if config.get(field):
            raise ValueError(f"LoRA adapter {label}: {why} ({field}={config[field]!r})")
    variant = next((key for key, value in config.items() if key.startswith("use_") and key != "use_rslora" and value
                    or key == "alora_invocation_tokens" and value), None)
    if variant is not None:
        raise ValueError(f"LoRA adapter {label}: a LoRA variant nanovllm does not compute ({variant}="
                         f"{config[variant]!r}); plain LoRA and rsLoRA run")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {label}: trained biases are not supported (bias={config['bias']!r}; PEFT's "
                         "'none' only)")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    for target in targets:
        if target in ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out"):
            raise ValueError(f"LoRA adapter {label}: LoRA on {target!r} (target_modules) is not supported; only the "
                             "decoder layers' projections")


def _read_weights(path: str, label: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"LoRA adapter {label}: no {' or '.join(WEIGHT_FILES)} in {path!r}")


def _pattern_value(patterns: dict, key: str, default: float) -> float:
    """PEFT's `rank_pattern` / `alpha_pattern` lookup: the first pattern that matches the end of `key` at a dot."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default
