"""GGUF files as Hugging Face model directories.

transformers' own GGUF reader (with the `gguf` package) parses the file, dequantizes the tensors
and rebuilds the tokenizer; this module writes the result out as safetensors, config.json and
tokenizer files, so the engine, and transformers itself, load it like any checkpoint. `LLM` does
this once per file into a cache directory (`$NANOVLLM_CACHE`, default `~/.cache/nanovllm`).
"""
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.models import model_class

INSTALL_HINT = 'pip install "nanovllm[demo]" (or: pip install gguf accelerate)'


def cache_dir() -> Path:
    """Where converted models live: `$NANOVLLM_CACHE`, else `$XDG_CACHE_HOME/nanovllm`, else `~/.cache/nanovllm`."""
    if os.environ.get("NANOVLLM_CACHE"):
        return Path(os.environ["NANOVLLM_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanovllm"


def find_gguf(model: str) -> str | None:
    """The GGUF file `model` stands for: the path itself, or the one .gguf in a directory without config.json."""
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model {model!r} is a file but not a .gguf file; pass a model directory or a .gguf file")
        return model
    if not os.path.isdir(model) or os.path.isfile(os.path.join(model, "config.json")):
        return None
    found = sorted(name for name in os.listdir(model) if name.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"model directory {model!r} holds several GGUF files {found}; pass the path of one of them")
    return os.path.join(model, found[0]) if found else None


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"reading GGUF files needs the {' and '.join(missing)} package(s): {INSTALL_HINT}")


def read_gguf_config(path: str) -> PretrainedConfig:
    """The model config recorded in a GGUF file (metadata only; no tensor is read), with its `architectures`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _require_gguf_support()
    config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    config.architectures = [name] if name else []
    return config


def _reject_scaled_rope(path: str) -> None:
    """transformers' GGUF reader drops Llama rope scaling (llama.cpp stores Llama 3.1's as a `rope_freqs` tensor),
    which would change every output; refuse such files rather than convert them wrongly."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors) or \
            any(key.endswith(".rope.scaling.factor") for key in reader.fields):
        raise ValueError(f"{path} scales its rope frequencies (e.g. Llama 3.1/3.2), which transformers' GGUF reader "
                         "ignores; load the model's original Hugging Face checkpoint instead")


def _dequantized() -> dict:
    """Newer transformers may keep GGUF blocks packed in special modules; ask for plain dense weights."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def convert_gguf(path: str, out_dir: str) -> None:
    """Write the GGUF model at `path` into `out_dir` as a float32 Hugging Face checkpoint with its tokenizer.

    `save_pretrained` refuses a model loaded from GGUF (it counts as quantized), so the dequantized
    state dict and the config are written directly; a tied LM head is stored once, as the embedding.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf_support()
    _reject_scaled_rope(path)
    source = dict(pretrained_model_name_or_path=os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    tokenizer = AutoTokenizer.from_pretrained(**source)
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
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def cached_conversion(path: str) -> str:
    """The converted directory of the GGUF file at `path`, converting it on first use.

    The cache key is the file's absolute path, size and modification time, so an edited or replaced
    file is converted again. The model's family is checked before any tensor is read, and a
    conversion becomes visible only when complete (written to a temporary directory, then renamed).
    """
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "gguf" / f"{Path(path).stem}-{key}"
    if (target / "config.json").is_file():
        return str(target)
    try:
        model_class(read_gguf_config(path))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"nanovllm: converting {path} into {target} (once; later runs reuse it) ...", file=sys.stderr)
    tmp = tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent)
    try:
        convert_gguf(path, tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_model(model: str) -> str:
    """`model` itself, or the converted directory of the GGUF file it names."""
    gguf = find_gguf(model)
    return cached_conversion(gguf) if gguf else model
