"""`python -m nanovllm convert`: a GGUF file written out as a float32 Hugging Face checkpoint, with transformers' GGUF
reader, for those who want one (transformers loads it too). `LLM("model.gguf")` needs none of this: it runs the file
as it is (`nanovllm.models.gguf`).

An embedding file (`{arch}.pooling_type`: BERT, which transformers' GGUF reader does not read, or a decoder) is written
by nanovllm's own reader instead, as the pooling runner reads it: its metadata directory (config, tokenizer and
sentence-transformers pooling files) and its tensors dequantized under transformers' names, so that the pooling runner
and sentence-transformers read the directory as the embedding model it is.
"""
import json
import os
import shutil

import torch

from nanovllm.models import model_class
from nanovllm.models.gguf.config import pooling_mode
from nanovllm.models.gguf.metadata import (
    SOURCES,
    cached_metadata,
    file_metadata,
    parsed_once,
    reject_scaled_rope,
    require_gguf_support,
    tokenizer_of,
)
from nanovllm.models.gguf.weights import TENSORS, gguf_weights, map_file
from nanovllm.models.loader import as_loaded
from nanovllm.progress import Progress

# embedding files whose tensors nanovllm names and lays out as the family's transformers checkpoint does
EMBEDDING_ARCHITECTURES = ("bert", "llama", "qwen2", "qwen3")


def _reject_rope_scaling_for_transformers(path: str) -> None:
    from gguf import GGUFReader

    if any(key.endswith(".rope.scaling.factor") for key in GGUFReader(path).fields):
        raise ValueError(f"{path} scales its rope frequencies, which transformers' GGUF reader ignores; load the "
                         "model's original Hugging Face checkpoint instead")


def _dequantized() -> dict:
    """Newer transformers may keep GGUF blocks packed in special modules; ask for plain dense weights."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def convert_gguf(path: str, out_dir: str, progress: Progress | None = None) -> None:
    """Write the GGUF model at `path` into `out_dir` as a float32 Hugging Face checkpoint with its tokenizer.

    `save_pretrained` refuses a model loaded from GGUF (it counts as quantized), so the dequantized
    state dict and the config are written directly; a tied LM head is stored once, as the embedding.
    Progress goes to stderr (`progress`: that of a caller already inside `parsed_once`). An embedding file goes to
    `_convert_embedding_file`.
    """
    require_gguf_support()
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if progress is None:
        with Progress("converted") as progress, parsed_once(progress):
            return convert_gguf(path, out_dir, progress)
    progress("reading the GGUF metadata")
    try:
        metadata = file_metadata(gguf.GGUFReader(path), path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e}); it may be truncated or corrupt") from None
    if pooling_mode(metadata):
        return _convert_embedding_file(path, metadata.arch, out_dir, progress)
    reject_scaled_rope(path)
    _reject_rope_scaling_for_transformers(path)
    source = dict(pretrained_model_name_or_path=os.path.dirname(os.path.abspath(path)),
                  gguf_file=os.path.basename(path))
    progress("building the tokenizer")
    tokenizer = tokenizer_of(path)
    progress("loading and dequantizing tensors", total=len(gguf.GGUFReader(path).tensors))
    model = AutoModelForCausalLM.from_pretrained(**source, **_dequantized(), dtype=torch.float32)
    config = model.config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    vars(config).pop("quantization_config", None)
    os.makedirs(out_dir, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
             if not (config.tie_word_embeddings and name == "lm_head.weight")}
    packed = [name for name, tensor in state.items() if tensor.dtype != torch.float32]
    if packed:
        raise ValueError(f"transformers kept GGUF weights of {path} packed ({packed[0]}, ...) instead of dequantizing "
                         "them; this transformers version cannot be used to convert GGUF files")
    progress(f"writing {sum(t.nbytes for t in state.values()) / 1e6:.0f} MB of weights, the config and the tokenizer")
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _convert_embedding_file(path: str, architecture: str, out_dir: str, progress: Progress) -> None:
    """Write the embedding file at `path` into `out_dir`: its metadata directory (`cached_metadata`: config,
    tokenizer, sentence-transformers pooling) and its tensors dequantized to float32 as the pooling runner loads them,
    under transformers' names. A ValueError for an architecture whose layout is not transformers' here."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    if architecture not in EMBEDDING_ARCHITECTURES:
        raise ValueError(f"{path} is a {architecture!r} embedding file, which convert does not write (it writes "
                         f"{list(EMBEDDING_ARCHITECTURES)} embedding files); run it as it is: LLM({path!r}) pools it")
    entry = cached_metadata(path, progress)
    table = json.loads((entry / TENSORS).read_text())
    progress("dequantizing tensors", total=len(table["tensors"]))
    config = AutoConfig.from_pretrained(entry)
    model_class(config)  # the config under the names the engine reads
    state = {}
    for name, tensor in as_loaded(gguf_weights(map_file(path), table, config), None, keep_ggml=False):
        state[name] = tensor.clone(memory_format=torch.contiguous_format)
        progress.advance()
    progress(f"writing {sum(t.nbytes for t in state.values()) / 1e6:.0f} MB of weights, the config, the tokenizer "
             "and the pooling")
    shutil.copytree(entry, out_dir, ignore=shutil.ignore_patterns(TENSORS, SOURCES), dirs_exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
