"""Load Hugging Face safetensors checkpoints into nanovllm models (packed and sharded parameters)."""
from collections import Counter

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.config import find_weight_files


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    """Copy every checkpoint tensor into its (possibly packed) parameter; fail on anything missing.

    `model.packed_modules_mapping` maps a checkpoint name fragment such as "q_proj" to the fused
    parameter ("qkv_proj") and the shard it fills. Checkpoint tensors with no parameter (a tied
    `lm_head.weight`, rotary buffers) are ignored.
    """
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    expected = Counter({name: 1 for name in params})
    for name in params:
        for fused in {v for v, _ in packed.values()}:
            if f".{fused}." in name:
                expected[name] = sum(1 for v, _ in packed.values() if v == fused)
    loaded: Counter = Counter()
    for file in find_weight_files(path):
        with safe_open(file, "pt", "cpu") as f:
            for weight_name in f.keys():
                for fragment, (fused, shard_id) in packed.items():
                    if f".{fragment}." in weight_name:
                        name = weight_name.replace(f".{fragment}.", f".{fused}.")
                        if name in params:
                            params[name].weight_loader(params[name], f.get_tensor(weight_name), shard_id)
                            loaded[name] += 1
                        break
                else:
                    if weight_name in params:
                        param = params[weight_name]
                        getattr(param, "weight_loader", default_weight_loader)(param, f.get_tensor(weight_name))
                        loaded[weight_name] += 1
    missing = sorted(name for name, count in expected.items() if loaded[name] < count)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {path!r} is missing weights for: {shown}")


def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    """Random weights (normal(0, std), norms at 1) for benchmarks and tests without a checkpoint."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.copy_(torch.randn(param.shape, generator=generator) * std)
