"""Load Hugging Face safetensors checkpoints into nanovllm models (packed and sharded parameters)."""
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from nanovllm.config import find_weight_files


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy every (checkpoint name, full tensor) into its (possibly packed) parameter; fail on anything missing.

    `model.packed_modules_mapping` maps a checkpoint name fragment such as "q_proj" to the fused
    parameter ("qkv_proj") and the shard it fills. Each parameter's `weight_loader` keeps only
    this tensor-parallel rank's slice. Tensors with no parameter (a tied `lm_head.weight`,
    rotary buffers) are ignored.
    """
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    expected = Counter({name: 1 for name in params})
    for name in params:
        for fused in {v for v, _ in packed.values()}:
            if f".{fused}." in name:
                expected[name] = sum(1 for v, _ in packed.values() if v == fused)
    loaded: Counter = Counter()
    for weight_name, tensor in weights:
        for fragment, (fused, shard_id) in packed.items():
            if f".{fragment}." in weight_name:
                name = weight_name.replace(f".{fragment}.", f".{fused}.")
                if name in params:
                    params[name].weight_loader(params[name], tensor, shard_id)
                    loaded[name] += 1
                break
        else:
            if weight_name in params:
                param = params[weight_name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded[weight_name] += 1
    missing = sorted(name for name, count in expected.items() if loaded[name] < count)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {source!r} is missing weights for: {shown}")


def _safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in find_weight_files(path):
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model: nn.Module, path: str) -> None:
    load_weights(model, _safetensors_weights(path), path)


def _dummy_weights(hf_config: PretrainedConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A random checkpoint in the Hugging Face layout: normal(0, initializer_range), norms at 1.

    Names and full shapes come from transformers' model built on the meta device, and tensors are
    drawn in that order from one seeded generator, so every tensor-parallel size slices the same
    full tensors.
    """
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    std = getattr(hf_config, "initializer_range", 0.02)
    generator = torch.Generator().manual_seed(seed)
    for name, param in reference.named_parameters():
        if name.endswith("norm.weight"):
            yield name, torch.ones(param.shape)
        else:
            yield name, torch.randn(param.shape, generator=generator) * std


def init_dummy_weights(model: nn.Module, hf_config: PretrainedConfig, seed: int) -> None:
    """Random weights for benchmarks and tests without a checkpoint, identical for every tensor-parallel size."""
    load_weights(model, _dummy_weights(hf_config, seed), f"dummy weights for {hf_config.model_type}")
