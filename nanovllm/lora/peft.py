"""A PEFT LoRA directory (`adapter_config.json` and `adapter_model.safetensors` or `.bin`) read into plain tensors: the
A and B matrix and the scale of every adapted projection, by decoder layer and Hugging Face projection name.

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
from dataclasses import dataclass

import torch

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


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


def read_peft_adapter(path: str, label: str) -> PeftAdapter:
    """The adapter in the PEFT directory `path` (`label` names it in errors); a FileNotFoundError when the directory
    or its files are missing, a ValueError for what nanovllm cannot run."""
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
    parts: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {label}: {key!r} is not LoRA on a decoder layer's projection "
                             "(model.layers.N.self_attn.* or model.layers.N.mlp.*); embedding, LM-head and other "
                             "modules' LoRA is not supported")
        layer, block, name, which = match.groups()
        parts.setdefault((int(layer), block, name), {})[which] = tensor
    modules = []
    for (layer, block, name), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {label}: model.layers.{layer}.{block}.{name} has lora_{''.join(ab)} "
                             "but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.size(0) != b.size(1):
            raise ValueError(f"LoRA adapter {label}: model.layers.{layer}.{block}.{name} has lora_A {tuple(a.shape)} "
                             f"and lora_B {tuple(b.shape)}, which do not make a LoRA pair")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, f"model.layers.{layer}.{block}.{name}",
                               config.get("lora_alpha", 8))
        rank = a.size(0)
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules.append(LoRAModule(layer, name, a, b, scale))
    if not modules:
        raise ValueError(f"LoRA adapter {label}: {path!r} holds no LoRA weights")
    return PeftAdapter(path, modules)


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
