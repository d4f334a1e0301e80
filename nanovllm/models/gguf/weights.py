"""A GGUF file's weights as they are: memory-mapped, each tensor in its GGUF type, named as the model's parameters.

The file's tensor table (name, type, shape, where its bytes are) is read once, by gguf-py, into the file's metadata
directory (`nanovllm.models.gguf.metadata.cached_metadata`); later starts map the file and slice it without parsing it
again. A 2-D tensor comes out as a `GGMLTensor`, a zero-copy uint8 view of the mapped rows; a 1-D one (norms, biases) as
a float tensor. What llama.cpp's converter changed is undone on the rows, blocks untouched: the llama family's q and k
rows permuted (each head's rotary halves interleaved), q/k/v fused (Phi-3, GPT-NeoX) and gate/up (Phi-3), every expert's
projection in one 3-D tensor (given to the model one expert at a time); Gemma's norms stored as 1 + w.
"""
import json
import math
import mmap
import os
from collections.abc import Iterator

import numpy as np
import torch

from nanovllm.kernels.ggml import BLOCK, FLOAT_TYPES, type_name
from nanovllm.layers.ggml_weight import GGMLTensor
from nanovllm.models.hf_config import head_dim

# llama.cpp's `general.architecture` names that nanovllm runs
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma", "gemma2", "gemma3", "phi3", "olmo2",
                 "granite", "stablelm", "gptneox", "bert")
PERMUTED_QK = ("llama", "granite")  # llama.cpp's converter interleaves these families' rotary halves
SHIFTED_NORMS = ("gemma", "gemma2", "gemma3")  # norms stored as 1 + w (Gemma's RMSNorm scales by 1 + w)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate_inp": "mlp.gate",
               "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
               "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# where a family's Hugging Face names differ from Llama's
ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"}, "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "gptneox": {"ffn_up": "mlp.fc_in"}, "llama": {"ffn_gate_inp": "block_sparse_moe.gate"},
    "stablelm": {"attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm"}}
# BERT's tensors under transformers' `BertModel` names (its layers' under "encoder.layer.{n}.")
BERT_GLOBAL_NAMES = {"token_embd": "embeddings.word_embeddings", "position_embd": "embeddings.position_embeddings",
                     "token_types": "embeddings.token_type_embeddings", "token_embd_norm": "embeddings.LayerNorm"}
BERT_LAYER_NAMES = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
                    "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
                    "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
# 3-D tensors of every expert's projection, given to the model one expert at a time, under the family's names
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
ARCH_EXPERTS = {"llama": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"})}
FUSED = ("attn_qkv",)  # q, k and v rows in one tensor (Phi-3, GPT-NeoX), given to the model as three
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE: read into the config
TENSORS = "tensors.json"  # the tensor table's file in the metadata directory
# tensors whose input dimension tensor parallelism splits (row-parallel layers)
INPUT_SPLIT = ("attn_output", "ffn_down", "ffn_down_exps", "ffn_down_shexp")


def hf_name(name: str, architecture: str) -> str | None:
    """The Hugging Face parameter name of GGUF tensor `name` in a file of `architecture` ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"; an expert tensor's with "{expert}" in place of the expert's index, a
    fused q/k/v's with "{qkv}" for q_proj, k_proj and v_proj; a BERT file's as transformers' `BertModel` names them),
    or None for a tensor the models do not have."""
    base, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    bert = architecture == "bert"
    global_names = BERT_GLOBAL_NAMES if bert else GLOBAL_NAMES
    if base in global_names:
        return f"{global_names[base]}.{kind}"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, tensor = parts[1], parts[2]
    if bert:
        return f"encoder.layer.{layer}.{BERT_LAYER_NAMES[tensor]}.{kind}" if tensor in BERT_LAYER_NAMES else None
    if tensor in EXPERTS:
        prefix, names = ARCH_EXPERTS.get(architecture, ("mlp", EXPERTS))
        return f"model.layers.{layer}.{prefix}.experts.{{expert}}.{names[tensor]}.{kind}"
    if tensor in FUSED:
        return f"model.layers.{layer}.self_attn.{{qkv}}.{kind}"
    module = ARCH_LAYER_NAMES.get(architecture, {}).get(tensor) or LAYER_NAMES.get(tensor)
    return f"model.layers.{layer}.{module}.{kind}" if module else None


def tensor_table(reader, path: str) -> dict:
    """What loading needs of a parsed file (a `gguf.GGUFReader`), checked: a supported architecture, every tensor of
    a supported type with a parameter to go to, and all its bytes in the file. A ValueError naming the problem."""
    import gguf

    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {architecture!r}; nanovllm runs "
                         f"{sorted(ARCHITECTURES)}")
    size, tensors = os.path.getsize(path), []
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        if qtype not in BLOCK:
            raise ValueError(f"{path}: tensor {t.name!r} has GGML type {gguf.GGMLQuantizationType(qtype).name}, "
                             f"which nanovllm does not run; supported types: {sorted(map(type_name, BLOCK))}")
        if hf_name(t.name, architecture) is None and t.name not in ("rope_freqs.weight", *ROPE_FACTORS):
            raise ValueError(f"{path}: tensor {t.name!r} has no place in a {architecture} model")
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, the "
                             f"file has {size}; download or convert it again")
        tensors.append([t.name, qtype, [int(n) for n in t.shape], int(t.data_offset), int(t.n_bytes)])
    return {"architecture": architecture, "tensors": tensors}


def read_table(metadata: str) -> dict:
    """The tensor table kept in a GGUF file's metadata directory."""
    with open(os.path.join(metadata, TENSORS)) as f:
        return json.load(f)


def check_table(table: dict, path: str, tensor_parallel_size: int) -> None:
    """The file still holds every tensor's bytes (a ValueError if it was truncated since), and with tensor
    parallelism each rank gets whole blocks of the input dimensions it splits."""
    size = os.path.getsize(path)
    for name, qtype, shape, offset, nbytes in table["tensors"]:
        if offset + nbytes > size:
            raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte {offset + nbytes}, the file has "
                             f"{size}; download or convert it again")
        values, split = BLOCK[qtype][0], name.split(".")[-2] in INPUT_SPLIT
        if tensor_parallel_size > 1 and split and shape[0] // tensor_parallel_size % values:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} splits the {shape[0]} inputs of {name!r} "
                             f"into {shape[0] // tensor_parallel_size} per rank, not whole {values}-value "
                             f"{type_name(qtype)} blocks; choose a size that divides {shape[0] // values}")


def llama_cpp_order(rows: int, heads: int) -> torch.Tensor:
    """Index of the GGUF row holding each original q/k row (`original = gguf[index]`)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def map_file(path: str) -> np.memmap:
    """The file mapped copy-on-write: writable views for torch, and no page of it is ever written."""
    return np.memmap(path, mode="c")


def drop_resident_pages(mapped: np.memmap) -> None:
    """Once loaded, forget which pages of the file were read: the rows copied at load (fused projections, llama's
    q/k) are never read again, and those the model still views come back from the page cache on their next use."""
    mapped._mmap.madvise(mmap.MADV_DONTNEED)


def _small(data: torch.Tensor, qtype: int, shape: list[int]) -> torch.Tensor:
    """A norm, bias or router-gate vector as a float32 tensor of `shape` (GGUF's order, innermost first)."""
    dims = shape[::-1]
    if qtype in FLOAT_TYPES:
        return data.view(FLOAT_TYPES[qtype]).float().view(dims)
    return GGMLTensor(data.view(math.prod(dims[:-1]), -1), qtype, shape[0]).dequantize().view(dims)


def _pieces(target: str, tensor: torch.Tensor | GGMLTensor, kind: str, architecture: str,
            qkv_sizes: list[int]) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
    """A fused tensor's row blocks under their own names: q/k/v (`attn_qkv`), Phi-3's gate/up (its `ffn_up`)."""
    if kind in FUSED:
        names, sizes = ("q_proj", "k_proj", "v_proj"), qkv_sizes
    elif architecture == "phi3" and kind == "ffn_up":
        target, names = target.replace(".up_proj.", ".{part}."), ("gate_proj", "up_proj")
        sizes = [tensor.size(0) // 2] * 2
    else:
        yield target, tensor
        return
    start = 0
    for name, size in zip(names, sizes):
        yield target.format(qkv=name, part=name), tensor[start:start + size]
        start += size


def gguf_weights(mapped: np.memmap, table: dict, hf_config) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
    """Every tensor of the mapped file under its Hugging Face name, as llama.cpp's converter found it: 2-D ones as
    `GGMLTensor` views of the mapped file (q/k rows of llama files reordered: a copy), an expert tensor one expert at
    a time and fused q/k/v or gate/up in their parts (row views), norms and biases as float32 tensors (Gemma's norms
    back to w from the 1 + w stored)."""
    mapped = mapped.view(np.ndarray)  # slicing a plain view costs a third of slicing the np.memmap
    architecture = table["architecture"]
    heads = {"attn_q": hf_config.num_attention_heads, "attn_k": hf_config.num_key_value_heads}
    q_size, kv_size = (n * head_dim(hf_config) for n in (hf_config.num_attention_heads, hf_config.num_key_value_heads))
    permuted = architecture in PERMUTED_QK
    for name, qtype, shape, offset, nbytes in table["tensors"]:
        if name == "rope_freqs.weight" or name in ROPE_FACTORS:
            continue
        data, kind, target = torch.from_numpy(mapped[offset:offset + nbytes]), name.split(".")[-2], \
            hf_name(name, architecture)
        rows = shape[1] if len(shape) >= 2 else shape[0]
        order = llama_cpp_order(rows, heads[kind]) if permuted and kind in heads else slice(None)
        if len(shape) == 1 or kind.endswith("_norm"):
            tensor = _small(data, qtype, shape)[order]
            if architecture in SHIFTED_NORMS and kind.endswith("norm"):
                tensor = tensor - 1
            if kind == "ffn_gate_inp_shexp":
                tensor = tensor.view(1, -1)
        elif len(shape) == 3:
            stacked = GGMLTensor(data.view(shape[2] * shape[1], -1), qtype, shape[0])
            for expert in range(shape[2]):
                yield target.format(expert=expert), stacked[expert * shape[1]:(expert + 1) * shape[1]]
            continue
        else:
            tensor = GGMLTensor(data.view(shape[1], -1), qtype, shape[0]).rows(order)
        yield from _pieces(target, tensor, kind, architecture, [q_size, kv_size, kv_size])
