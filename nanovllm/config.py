"""Engine settings, validated once, before any model weights are touched."""
import json
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.backends import ATTENTION_BACKENDS, choose_backend
from nanovllm.gguf_import import resolve_model
from nanovllm.layers.prepack import native_bfloat16
from nanovllm.models import model_class
from nanovllm.models.hf_config import head_dim
from nanovllm.models.loader import find_weight_files

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Config:
    """Everything the engine needs to know before it starts.

    `model` is a Hugging Face style directory (config.json, *.safetensors, tokenizer files), or a
    GGUF file (or a directory holding one), which is converted once into a cached directory that
    then replaces it in `model`. With `load_format="dummy"` the weights are random and only
    config.json is required.
    `attention_backend` names the attention kernels ("auto", "flash-attn", "flash-attn-4", "triton",
    "torch"; see `nanovllm.backends.select_backend`); like `device` and `dtype`, "auto" is replaced by
    what was chosen.
    On CPU the KV cache is sized from `cpu_kvcache_gib` (GiB of host memory); on CUDA
    from `gpu_memory_utilization` of the device memory. A positive `num_kvcache_blocks`
    overrides both. `max_model_len` defaults to the model's `max_position_embeddings` (without
    chunked prefill, at most `max_num_batched_tokens`), lowered by the model runner to what the
    KV cache holds; a value given explicitly is never lowered.
    """

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"
    cpu_kvcache_gib: float = 4.0
    distributed_timeout_s: float = 300.0
    seed: int = 0
    max_logprobs: int = 20
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    hf_config: PretrainedConfig = field(init=False, repr=False)
    max_model_len_given: bool = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        self._check_engine_settings()
        self.model = resolve_model(self.model)
        self.hf_config = load_hf_config(self.model)
        if self.load_format == "auto":
            find_weight_files(self.model)
        self.device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.device, self.hf_config)
        self.attention_backend = choose_backend(self.attention_backend, self.device, self.torch_dtype,
                                                self.kvcache_block_size, head_dim(self.hf_config))
        self.max_model_len_given = self.max_model_len is not None
        if self.max_model_len_given:
            self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        else:
            self.max_model_len = self.hf_config.max_position_embeddings
            if not self.enable_chunked_prefill:
                self.max_model_len = min(self.max_model_len, self.max_num_batched_tokens)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}): without chunked prefill a max-length prompt could never be scheduled. "
                "Raise max_num_batched_tokens, lower max_model_len or enable_chunked_prefill=True."
            )
        self._check_tensor_parallel()

    def _check_engine_settings(self) -> None:
        positive = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "kvcache_block_size", "tensor_parallel_size")
        for name in positive:
            value = getattr(self, name)
            if name == "max_model_len" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not (self.num_kvcache_blocks == -1 or self.num_kvcache_blocks >= 1):
            raise ValueError(f"num_kvcache_blocks must be -1 (auto) or a positive integer, got {self.num_kvcache_blocks}")
        if self.cpu_kvcache_gib <= 0:
            raise ValueError(f"cpu_kvcache_gib must be positive, got {self.cpu_kvcache_gib}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, got {self.max_logprobs!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")

    def _check_tensor_parallel(self) -> None:
        """Every rank must own whole query heads, whole KV heads and an equal slice of the MLP.

        KV heads are never replicated: a size with fewer KV heads than ranks is rejected, which keeps
        each rank's KV cache disjoint (replication would store the same heads on several ranks).
        """
        tp, cfg = self.tensor_parallel_size, self.hf_config
        sizes = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                 "intermediate_size": cfg.intermediate_size}
        if any(size % tp for size in sizes.values()):
            valid = [n for n in range(1, cfg.num_key_value_heads + 1) if not any(size % n for size in sizes.values())]
            shown = ", ".join(f"{name} ({size})" for name, size in sizes.items())
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {shown}; "
                             f"valid sizes for this model: {valid}")
        if self.device == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} but only {torch.cuda.device_count()} CUDA device(s) are visible")


def load_hf_config(model: str) -> PretrainedConfig:
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory not found: {model!r} "
                                "(pass a local Hugging Face model directory or a .gguf file)")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model!r}")
    try:
        with open(path) as f:
            json.load(f)
        cfg = AutoConfig.from_pretrained(model)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{path} is not a valid Hugging Face model config: {e}") from e
    try:
        model_class(cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return cfg


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available; use device='cpu' or 'auto'")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return device


def resolve_dtype(dtype: str, device: str, cfg: PretrainedConfig) -> torch.dtype:
    """'auto', as vLLM: on CUDA the checkpoint's half-precision dtype, bfloat16 for a float32 checkpoint; on CPU
    bfloat16 where the CPU computes it natively (AVX512-BF16, AMX), else float32 (emulated bfloat16 is several
    times slower than float32 there)."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.bfloat16 if native_bfloat16() else torch.float32
    model_dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(model_dtype, str):
        model_dtype = _DTYPES.get(model_dtype)
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
