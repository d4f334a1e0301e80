"""A LoRA adapter as llama.cpp's `convert_lora_to_gguf.py` writes it (`general.type = adapter`, `adapter.type = lora`,
`adapter.lora.alpha`), read into the PEFT adapter's form (`PeftAdapter`), so both run the same way from there.

The file holds, per adapted base tensor, `<base tensor>.lora_a` (rank x in) and `.lora_b` (out x rank) under llama.cpp's
tensor names, transformed as the base model's converter transforms that tensor: Llama's and Granite's q/k rows
permuted (undone here on B's rows), GPT-NeoX's q/k/v regrouped and Phi-3's q/k/v and gate/up kept fused (each one
module, as in PEFT). Every pair's scale is alpha / its rank, or 1 when alpha is 0 or absent, as llama.cpp computes it
(`rank_pattern` survives the conversion in the ranks; `alpha_pattern` and rsLoRA do not). What llama.cpp would refuse
or skip (another architecture, a model file, a half pair, norm vectors, embedding or LM-head LoRA) is a ValueError.
"""
import os

import numpy as np
import torch
from transformers import PretrainedConfig

from nanovllm.lora.peft import PROJECTION, LoRAModule, PeftAdapter
from nanovllm.models.gguf.metadata import INSTALL_HINT, find_gguf, require_gguf_support
from nanovllm.models.gguf.weights import PERMUTED_QK, hf_name, llama_cpp_order

# llama.cpp's `general.architecture` of each model_type nanovllm runs (its converter names Mistral and Mixtral llama)
LLAMA_CPP_ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3",
    "phi3": "phi3", "olmo2": "olmo2", "granite": "granite", "stablelm": "stablelm", "gpt_neox": "gptneox"}
FUSED_MLP = ("phi3",)  # `ffn_up` holds the gate and up rows (Phi-3's gate_up_proj)


def gguf_adapter_file(path: str, label: str) -> str | None:
    """The GGUF file `lora_path` names: the path itself, or the one .gguf in a directory without adapter_config.json;
    None for anything else (a PEFT directory, or a directory that does not exist)."""
    if path.endswith(".gguf") and not os.path.exists(path):
        raise FileNotFoundError(f"LoRA adapter {label}: no file {path!r}")
    return find_gguf(path, "adapter_config.json", f"LoRA adapter {label}: lora_path", "a PEFT adapter directory")


def read_gguf_adapter(path: str, label: str, hf_config: PretrainedConfig) -> PeftAdapter:
    """The llama.cpp LoRA adapter in the GGUF file `path` (`label` names it in errors), for a base model of
    `hf_config`: B's rows back in the Hugging Face order, each projection under its PEFT name."""
    try:
        require_gguf_support(("gguf",))
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"LoRA adapter {label}: reading GGUF adapters needs the gguf package: "
                                  f"{INSTALL_HINT}") from None
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ValueError(f"LoRA adapter {label}: {path!r} is not a readable GGUF file ({e}); it may be truncated or "
                         "corrupt") from None
    architecture = _check_metadata(reader, path, label, hf_config)
    field = reader.fields.get(gguf.Keys.Adapter.LORA_ALPHA)
    alpha = float(field.contents()) if field is not None else 0.0
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        base, _, which = tensor.name.rpartition(".")
        if which not in ("lora_a", "lora_b"):
            why = "norm vectors, which llama.cpp skips" if tensor.name.endswith("_norm.weight") else \
                "neither a .lora_a nor a .lora_b tensor"
            raise ValueError(f"LoRA adapter {label}: {path!r} holds {tensor.name!r}, {why}; nanovllm runs only the "
                             "LoRA pairs of the decoder layers' projections")
        if len(tensor.shape) != 2:
            raise ValueError(f"LoRA adapter {label}: {tensor.name!r} has {len(tensor.shape)} dimensions; LoRA on "
                             "stacked experts is not supported, only the decoder layers' projections")
        if tensor.data_offset + tensor.n_bytes > os.path.getsize(path):
            raise ValueError(f"LoRA adapter {label}: {path!r} is truncated (tensor {tensor.name!r} ends past the end)")
        data = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(int(tensor.tensor_type)))
        pairs.setdefault(base, {})[which] = torch.from_numpy(np.array(data, dtype=np.float32))
    modules = [_module(base, ab, architecture, alpha, hf_config, label) for base, ab in pairs.items()]
    if not modules:
        raise ValueError(f"LoRA adapter {label}: {path!r} holds no LoRA tensors")
    return PeftAdapter(path, sorted(modules, key=lambda module: (module.layer, module.name)))


def _check_metadata(reader, path: str, label: str, hf_config: PretrainedConfig) -> str:
    """The adapter's architecture, checked: a LoRA adapter (not a model, not an aLoRA) for the base's architecture."""
    import gguf

    def text(key: str) -> str | None:
        field = reader.fields.get(key)
        return field.contents() if field is not None else None

    kind = text(gguf.Keys.General.TYPE)
    if kind != "adapter":
        raise ValueError(f"LoRA adapter {label}: {path!r} is not a LoRA adapter (general.type={kind!r}, not "
                         "'adapter'; a model file?): convert the PEFT adapter with llama.cpp's convert_lora_to_gguf.py")
    if text(gguf.Keys.Adapter.TYPE) != "lora":
        raise ValueError(f"LoRA adapter {label}: {path!r} is a {text(gguf.Keys.Adapter.TYPE)!r} adapter "
                         "(adapter.type); only 'lora' adapters run")
    if gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS in reader.fields:
        raise ValueError(f"LoRA adapter {label}: {path!r} is an activated LoRA "
                         f"({gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS}), which nanovllm does not compute")
    architecture, base = text(gguf.Keys.General.ARCHITECTURE), LLAMA_CPP_ARCHITECTURES.get(hf_config.model_type)
    if architecture != base:
        raise ValueError(f"LoRA adapter {label}: {path!r} is an adapter for a {architecture!r} model, but the base "
                         f"model is {hf_config.model_type!r} (llama.cpp's {base!r}): convert the adapter against this "
                         "base model")
    return architecture


def _module(base: str, ab: dict[str, torch.Tensor], architecture: str, alpha: float, hf_config: PretrainedConfig,
            label: str) -> LoRAModule:
    """The pair `ab` of GGUF tensor `base` as the LoRAModule of its PEFT projection."""
    if set(ab) != {"lora_a", "lora_b"}:
        raise ValueError(f"LoRA adapter {label}: {base} has {' '.join(ab)} but not both lora_a and lora_b")
    a, b = ab["lora_a"], ab["lora_b"]
    if a.size(0) != b.size(1):
        raise ValueError(f"LoRA adapter {label}: {base} has lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} "
                         "(rank x in, out x rank), which do not make a LoRA pair")
    match = PROJECTION.match((hf_name(base, architecture) or "").replace("{qkv}", "qkv_proj"))
    if match is None:
        raise ValueError(f"LoRA adapter {label}: {base} is not a decoder layer's projection; embedding, LM-head and "
                         "other tensors' LoRA is not supported")
    layer, name = match.groups()
    if architecture in FUSED_MLP and name == "up_proj":
        name = "gate_up_proj"
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}.get(name)
    if architecture in PERMUTED_QK and heads and b.size(0) % (2 * heads) == 0:
        b = b[llama_cpp_order(b.size(0), heads)]
    rank = a.size(0)
    return LoRAModule(int(layer), name, a, b, alpha / rank if alpha else 1.0)
