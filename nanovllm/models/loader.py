"""Load Hugging Face safetensors checkpoints and GGUF files into nanovllm models (packed and sharded parameters).

Weights in GGML blocks (a GGUF file's, or linear weights quantized at load with `quantization=`) stay in blocks: the
layers keep their rows aside and `install_ggml_weights` makes them the layers' weights. With `keep_ggml=False` (CUDA,
or no CPU kernels) they are dequantized once here instead, to the model's dtype.
"""
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, PretrainedConfig

from nanovllm.config import QUANTIZATIONS
from nanovllm.kernels.ggml import TYPE_IDS
from nanovllm.layers.ggml_weight import GGMLTensor, GGMLWeight, quantize
from nanovllm.layers.moe import FusedMoE
from nanovllm.models.gguf.weights import drop_resident_pages, gguf_weights, map_file
from nanovllm.models.hf_config import head_dim, is_classifier, is_encoder


def find_weight_files(model: str) -> list[str]:
    files = sorted(os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in model directory {model!r}")
    return files


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def shard_args(shard) -> tuple:
    return () if shard is None else (shard,)


def _load(param: nn.Parameter, name: str, source: str, tensor: torch.Tensor | GGMLTensor, shard=None) -> None:
    """`param`'s loader on checkpoint tensor `name`; a tensor it cannot take is a ValueError naming the tensor."""
    try:
        getattr(param, "weight_loader", default_weight_loader)(param, tensor, *shard_args(shard))
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r} in {source!r}: {e}") from None


EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.([^.]+)\.weight$")


def resolve_name(weight_name: str, packed: dict, experts: dict) -> tuple[str, object]:
    """The parameter a checkpoint tensor (under the model's own names) goes to, and its shard: the expert and
    projection of a per-expert tensor, the part of a fused projection, or None for the whole parameter."""
    expert = EXPERT_WEIGHT.search(weight_name)
    if expert and expert.group(2) in experts:
        fused, shard = experts[expert.group(2)]
        return f"{weight_name[:expert.start()]}.experts.{fused}", (int(expert.group(1)), shard)
    for fragment, (fused, shard_id) in packed.items():
        if f".{fragment}." in weight_name:
            return weight_name.replace(f".{fragment}.", f".{fused}."), shard_id
    return weight_name, None


@dataclass
class WeightSlot:
    """A parameter of the model as it was built: the module attribute that holds it (a float parameter, a
    oneDNN-packed one, a `GGMLWeight`, or per-expert lists of those, once loaded), the loader that fills it from
    checkpoint tensors, its shape and dtype on this rank as built, and the shards a complete load gives it."""

    module: nn.Module
    attr: str
    loader: Callable
    shape: torch.Size
    dtype: torch.dtype
    shards: frozenset

    @property
    def value(self):
        return getattr(self.module, self.attr)


@dataclass
class LoadRecord:
    """What `load_weights` leaves on a model (`model.load_record`) for `reload_weights`: its parameters as built
    (by name), the other names of tied parameters (a tied LM head), the GGML type each (parameter, shard) was given
    in, and transformers' names and full shapes of the checkpoint (read at the first reload)."""

    slots: dict[str, WeightSlot]
    aliases: dict[str, tuple[str, nn.Module, str]]  # a tied parameter's later name -> (first name, module, attribute)
    ggml_types: dict[tuple[str, object], int]
    checkpoint_shapes: dict[str, tuple[int, ...]] | None = None


def _expected_shards(model: nn.Module, params: dict[str, nn.Parameter]) -> dict[str, frozenset]:
    packed = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_modules_mapping", {})
    expected: dict[str, frozenset] = {name: frozenset({None}) for name in params}
    for name, param in params.items():
        for fused in {v for v, _ in packed.values()}:
            if f".{fused}." in name:
                expected[name] = frozenset(shard for v, shard in packed.values() if v == fused)
        for fused in {v for v, _ in experts.values()}:
            if name.endswith(f".experts.{fused}"):
                expected[name] = frozenset((e, shard) for v, shard in experts.values() if v == fused
                                           for e in range(param.size(0)))
    return expected


def _record(model: nn.Module, params: dict[str, nn.Parameter], expected: dict[str, frozenset],
            ggml_types: dict[tuple[str, object], int]) -> LoadRecord:
    slots = {}
    for name, param in params.items():
        prefix, _, attr = name.rpartition(".")
        slots[name] = WeightSlot(model.get_submodule(prefix), attr,
                                 getattr(param, "weight_loader", default_weight_loader), param.shape, param.dtype,
                                 expected[name])
    first = {id(param): name for name, param in params.items()}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first[id(param)] != name:
            prefix, _, attr = name.rpartition(".")
            aliases[name] = first[id(param)], model.get_submodule(prefix), attr
    return LoadRecord(slots, aliases, ggml_types)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy every (checkpoint name, full tensor) into its (possibly packed) parameter; fail on anything missing.

    A model's `checkpoint_weights` first turns the checkpoint's names and fused tensors into its own (see
    `DecoderForCausalLM`). `model.packed_modules_mapping` maps a checkpoint name fragment such as "q_proj" to the
    fused parameter ("qkv_proj") and the shard it fills. A mixture-of-experts family stacks its experts:
    `model.expert_modules_mapping` maps the projection of a per-expert name such as
    "...experts.3.gate_proj.weight" to the stacked parameter ("...experts.gate_up_proj") and the
    shard, which goes to its loader with the expert's index; a whole stacked tensor (transformers'
    own layout) loads as it is. Each parameter's `weight_loader` keeps only this tensor-parallel rank's slice.
    Tensors with no parameter (a tied `lm_head.weight`, rotary buffers) are ignored. The model keeps a
    `LoadRecord` (`model.load_record`), with which `reload_weights` replaces weights later through the same loaders.
    """
    if (rename := getattr(model, "checkpoint_weights", None)) is not None:
        weights = rename(weights)
    packed = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_modules_mapping", {})
    params = dict(model.named_parameters())
    expected = _expected_shards(model, params)
    loaded: dict[str, set] = {name: set() for name in params}
    ggml_types: dict[tuple[str, object], int] = {}
    for weight_name, tensor in weights:
        name, shard = resolve_name(weight_name, packed, experts)
        if name not in params:
            continue
        _load(params[name], weight_name, source, tensor, shard)
        if isinstance(tensor, GGMLTensor):
            ggml_types[name, shard] = tensor.qtype
        loaded[name] |= expected[name] if shard is None else {shard}
    missing = sorted(name for name in params if not expected[name] <= loaded[name])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {source!r} is missing weights for: {shown}")
    model.load_record = _record(model, params, expected, ggml_types)
    install_ggml_weights(model)


def install_ggml_weights(model: nn.Module) -> None:
    """Each layer that was given GGML rows (`ggml_parts`) gets its weight made of them: a `GGMLWeight`, or a float
    parameter in the model's dtype when every part is F32/F16/BF16 (float weights run on the float path). A weight
    shared by several layers (a tied LM head) is replaced in all of them. Experts are made by their own layer
    (`FusedMoE.install_ggml_weights`)."""
    made = {}
    for module in list(model.modules()):
        if isinstance(module, FusedMoE):
            module.install_ggml_weights()
            continue
        parts = getattr(module, "ggml_parts", None)
        if parts:
            old = module.weight
            weight = GGMLWeight.assemble(parts, old.size(0), old.dtype)
            if weight.is_float:
                weight = nn.Parameter(weight.dequantize(old.dtype), requires_grad=False)
            made[id(old)] = old, weight
            parts.clear()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in made:
                del module._parameters[name]
                setattr(module, name, made[id(param)][1])


def as_loaded(weights: Iterable[tuple[str, torch.Tensor | GGMLTensor]], quantization: str | None,
               keep_ggml: bool) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
    """Linear weights quantized (`quantization`), and GGML weights dequantized unless `keep_ggml`."""
    qtype = TYPE_IDS[QUANTIZATIONS[quantization]] if quantization else None
    for name, tensor in weights:
        if qtype is not None and name.endswith("_proj.weight"):
            tensor = quantize(tensor, qtype)
        if not keep_ggml and isinstance(tensor, GGMLTensor):
            tensor = tensor.dequantize()
        yield name, tensor


def _reference_model(hf_config: PretrainedConfig) -> nn.Module:
    """transformers' own model for this config on the meta device: the checkpoint's names and full shapes (a
    classifier's: its head instead of the LM head; an encoder's: its base model, as sentence-transformers saves it)."""
    auto = AutoModelForSequenceClassification if is_classifier(hf_config) else \
        AutoModel if is_encoder(hf_config) else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(hf_config)


def _shape_sources(hf_config: PretrainedConfig, config_json: dict) -> list[tuple[int, str]]:
    """Tensor dimensions the config implies, each with the config.json key(s) it comes from."""
    def key(name: str) -> str:
        value = getattr(hf_config, name, None)
        missing = "" if name in config_json else ", not in config.json: transformers' default"
        return f"{name}={value}{missing}"

    dim = head_dim(hf_config)
    head_key = key("head_dim") if "head_dim" in config_json else "head_dim (hidden_size / num_attention_heads)"
    return [(hf_config.vocab_size, key("vocab_size")), (hf_config.hidden_size, key("hidden_size")),
            (hf_config.intermediate_size, key("intermediate_size")),
            (hf_config.num_attention_heads * dim, f"{key('num_attention_heads')} x {head_key}"),
            (hf_config.num_key_value_heads * dim, f"{key('num_key_value_heads')} x {head_key}"),
            (dim, head_key)]


def _shape_mismatch(name: str, file: str, shape: tuple[int, ...], expected: tuple[int, ...],
                    sources: list[tuple[int, str]]) -> ValueError:
    culprit = next((i for i, (got, want) in enumerate(zip(shape, expected)) if got != want), None)
    if culprit is None:
        why = f"it has {len(shape)} dimensions, the model expects {len(expected)}"
    else:
        keys = [source for size, source in sources if size == expected[culprit]]
        why = f"dimension {culprit} is {shape[culprit]} but the config implies {expected[culprit]}" + (
            f" ({' or '.join(keys)})" if keys else "")
    return ValueError(f"weight {name!r} in {file} has shape {tuple(shape)}, but the model config expects "
                      f"{tuple(expected)}: {why}. The checkpoint and its config.json do not match; fix config.json "
                      "or use the config the weights were saved with.")


def reference_shapes(hf_config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """transformers' checkpoint names for this config and the full shape of each."""
    return {name: tuple(t.shape) for name, t in _reference_model(hf_config).state_dict().items()}


def _safetensors_weights(path: str, hf_config: PretrainedConfig,
                         expected: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, each checked against the full shape the config implies (`expected`, by name)
    before it is read."""
    with open(os.path.join(path, "config.json")) as f:
        sources = _shape_sources(hf_config, json.load(f))
    for file in find_weight_files(path):
        try:
            with safe_open(file, "pt", "cpu") as f:
                for name in f.keys():
                    shape = tuple(f.get_slice(name).get_shape())
                    if name in expected and shape != expected[name]:
                        raise _shape_mismatch(name, file, shape, expected[name], sources)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file ({e}); it may be truncated or corrupt: "
                             "download or convert it again") from None


def load_model(model: nn.Module, path: str, hf_config: PretrainedConfig, gguf_table: dict | None = None,
               quantization: str | None = None, keep_ggml: bool = True) -> None:
    """The weights of the model directory or GGUF file (with its tensor table `gguf_table`) at `path`."""
    if gguf_table is None:
        expected = reference_shapes(hf_config)
        load_weights(model, as_loaded(_safetensors_weights(path, hf_config, expected), quantization, keep_ggml), path)
        model.load_record.checkpoint_shapes = expected  # what a reload checks its tensors against
        return
    mapped = map_file(path)
    load_weights(model, as_loaded(gguf_weights(mapped, gguf_table, hf_config), None, keep_ggml), path)
    drop_resident_pages(mapped)


def _dummy_weights(hf_config: PretrainedConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A random checkpoint in the Hugging Face layout: normal(0, initializer_range), norms at 1.

    Names and full shapes come from transformers' model built on the meta device, and tensors are
    drawn in that order from one seeded generator, so every tensor-parallel size slices the same
    full tensors.
    """
    reference = _reference_model(hf_config)
    std = getattr(hf_config, "initializer_range", 0.02)
    generator = torch.Generator().manual_seed(seed)
    for name, param in reference.named_parameters():
        if name.endswith("norm.weight"):
            yield name, torch.ones(param.shape)
        else:
            yield name, torch.randn(param.shape, generator=generator) * std


def init_dummy_weights(model: nn.Module, hf_config: PretrainedConfig, seed: int, quantization: str | None = None,
                       keep_ggml: bool = True) -> None:
    """Random weights for benchmarks and tests without a checkpoint, identical for every tensor-parallel size."""
    load_weights(model, as_loaded(_dummy_weights(hf_config, seed), quantization, keep_ggml),
                 f"dummy weights for {hf_config.model_type}")
