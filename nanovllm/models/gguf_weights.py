"""A GGUF file's weights as they are: memory-mapped, each tensor in its GGUF type, named as the model's parameters.

The file's tensor table (name, type, shape, where its bytes are) is read once, by gguf-py, into the file's metadata
directory (`nanovllm.gguf_import.cached_metadata`); later starts map the file and slice it without parsing it again.
A 2-D tensor comes out as a `GGMLTensor`, a zero-copy uint8 view of the mapped rows; a 1-D one (norms, biases) as a
float tensor. llama.cpp stores the llama family's q and k rows permuted (each head's rotary halves interleaved);
`gguf_weights` undoes that on the rows themselves, blocks untouched.
"""
import json
import mmap
import os
from collections.abc import Iterator

import numpy as np
import torch

from nanovllm.quantization.ggml_ops import BLOCK
from nanovllm.quantization.ggml_weight import FLOAT_TYPES, GGMLTensor, type_name

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_QK = ("llama",)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
TENSORS = "tensors.json"  # the tensor table's file in the metadata directory
# tensors whose input dimension tensor parallelism splits (row-parallel layers)
INPUT_SPLIT = ("attn_output", "ffn_down")


def hf_name(name: str) -> str | None:
    """The Hugging Face parameter name of GGUF tensor `name` ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.
    q_proj.weight"), or None for a tensor the models do not have."""
    base, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
    return None


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
        if hf_name(t.name) is None and t.name != "rope_freqs.weight":
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


def _llama_cpp_order(rows: int, heads: int) -> torch.Tensor:
    """Index of the GGUF row holding each original q/k row (`original = gguf[index]`)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def map_file(path: str) -> np.memmap:
    """The file mapped copy-on-write: writable views for torch, and no page of it is ever written."""
    return np.memmap(path, mode="c")


def drop_resident_pages(mapped: np.memmap) -> None:
    """Once loaded, forget which pages of the file were read: the rows copied at load (fused projections, llama's
    q/k) are never read again, and those the model still views come back from the page cache on their next use."""
    mapped._mmap.madvise(mmap.MADV_DONTNEED)


def gguf_weights(mapped: np.memmap, table: dict, hf_config) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
    """Every tensor of the mapped file under its parameter name: 2-D ones as `GGMLTensor` views of the mapped
    file (q/k rows of llama files reordered: a copy), 1-D ones as float32 tensors."""
    mapped = mapped.view(np.ndarray)  # slicing a plain view costs a third of slicing the np.memmap
    heads = {"attn_q": hf_config.num_attention_heads, "attn_k": hf_config.num_key_value_heads}
    permuted = table["architecture"] in PERMUTED_QK
    for name, qtype, shape, offset, nbytes in table["tensors"]:
        if name == "rope_freqs.weight":
            continue
        data, kind = torch.from_numpy(mapped[offset:offset + nbytes]), name.split(".")[-2]
        rows = shape[1] if len(shape) == 2 else shape[0]
        order = _llama_cpp_order(rows, heads[kind]) if permuted and kind in heads else slice(None)
        if len(shape) == 2:
            yield hf_name(name), GGMLTensor(data.view(shape[1], -1), qtype, shape[0]).rows(order)
        elif qtype in FLOAT_TYPES:
            yield hf_name(name), data.view(FLOAT_TYPES[qtype]).float()[order]
        else:
            yield hf_name(name), GGMLTensor(data.view(1, -1), qtype, shape[0]).dequantize()[0][order]
