"""Which backend runs: `select_backend` reads the `BACKENDS` rows against a `Platform` (what this machine offers)."""
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm.kernels.attention import registry
from nanovllm.kernels.attention.kv_quant import INT8_CACHE
from nanovllm.kernels.attention.registry import BackendSpec, library_installed

logger = logging.getLogger("nanovllm")


@dataclass(frozen=True)
class Platform:
    """What this machine offers the backends: `probe` looks; tests build one by hand."""

    device: str
    capability: tuple[int, int] | None = None
    installed: Callable[[str], bool] = library_installed
    triton_interpret: bool = False

    @classmethod
    def probe(cls, device: str) -> "Platform":
        capability = torch.cuda.get_device_capability() if device == "cuda" else None
        interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
        return cls(device, capability, library_installed, interpret)


def unsupported(name: str, platform: Platform, dtype: torch.dtype, block_size: int, head_dim: int,
                kv_cache_dtype: torch.dtype | None = None) -> str | None:
    """Why backend `name` cannot serve this model here, or None when it can (from its `BackendSpec`); the KV cache
    holds `kv_cache_dtype` (None: `dtype`). Installation is checked last, so that installing is suggested only where
    it would help."""
    spec = registry.BACKENDS[name]
    eight_bit = kv_cache_dtype is not None and kv_cache_dtype.itemsize == 1
    if kv_cache_dtype == INT8_CACHE and not spec.reads_int8_cache:
        return ("cannot read an int8 KV cache (kv_cache_dtype='int8'): use attention_backend='triton' (or 'torch'), "
                "or leave kv_cache_dtype='auto'")
    if eight_bit and not spec.reads_8bit_cache:
        return (f"cannot read an 8-bit KV cache ({str(kv_cache_dtype).removeprefix('torch.')}, from kv_cache_dtype): "
                "leave kv_cache_dtype='auto', or use attention_backend='triton'")
    if eight_bit and platform.device == "cpu" and block_size % (multiple := spec.cpu_8bit_block_multiple):
        return (f"keeps an 8-bit KV cache's K in tiles of {multiple} tokens on the CPU: kvcache_block_size must be a "
                f"multiple of {multiple}, got {block_size}; use 16 (the default) or kv_cache_dtype='auto'")
    if platform.device not in spec.devices:
        if not spec.interpretable:
            return f"needs a {'CUDA GPU' if 'cuda' in spec.devices else ' or '.join(spec.devices)}"
        if not platform.triton_interpret:
            return "needs a CUDA GPU (or TRITON_INTERPRET=1, to run its kernels in Triton's interpreter on the CPU)"
    elif platform.device == "cuda" and (reason := _unsupported_on_gpu(spec, platform.capability, dtype, block_size,
                                                                      head_dim)) is not None:
        return reason
    if spec.library is not None and not platform.installed(name):
        return f"is not installed; {spec.install}"
    return None


def _unsupported_on_gpu(spec: BackendSpec, capability: tuple[int, int], dtype: torch.dtype, block_size: int,
                        head_dim: int) -> str | None:
    gpu = f"this GPU has compute capability {capability[0]}.{capability[1]}"
    lowest, past = spec.capability
    if not lowest <= capability < past:
        return f"{spec.capability_reason}; {gpu}"
    if dtype == torch.bfloat16 and capability < spec.bfloat16_from:
        return (f"runs bfloat16 from compute capability {spec.bfloat16_from[0]}.{spec.bfloat16_from[1]} (Ampere) on; "
                f"{gpu}: use dtype='float16'")
    if dtype not in spec.dtypes:
        names = " and ".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        return f"runs {names} only, not {str(dtype).removeprefix('torch.')}"
    max_head_dim = spec.max_head_dim_by_major.get(capability[0], spec.max_head_dim)
    if head_dim % spec.head_dim_multiple or max_head_dim is not None and not spec.head_dim_multiple <= head_dim <= \
            max_head_dim:
        return (f"needs a head_dim that is a multiple of {spec.head_dim_multiple} up to {max_head_dim}; this model's "
                f"is {head_dim}")
    if block_size % spec.block_multiple:
        return (f"needs a kvcache_block_size that is a multiple of {spec.block_multiple}, got {block_size}; use 256 "
                "(the default)")
    return None


def select_backend(requested: str, platform: Platform, dtype: torch.dtype, block_size: int, head_dim: int,
                   kv_cache_dtype: torch.dtype | None = None) -> tuple[str, dict[str, str]]:
    """The backend to run, and for "auto" why each one preferred to it was passed over.

    "auto" takes, in `BACKENDS` order, the first backend made for this device (the interpreter does not count)
    that can serve this dtype, block size, head_dim and KV cache dtype here; torch serves everything but an 8-bit cache
    on the CPU in blocks that cannot hold whole key tiles. A named backend that cannot, or no backend at all, is a
    ValueError saying why.
    """
    if requested != "auto":
        reason = unsupported(requested, platform, dtype, block_size, head_dim, kv_cache_dtype)
        if reason is not None:
            raise ValueError(f"attention_backend={requested!r} cannot run here: {requested} {reason}")
        return requested, {}
    passed_over = {}
    for name, spec in registry.BACKENDS.items():
        if platform.device not in spec.devices:
            continue
        reason = unsupported(name, platform, dtype, block_size, head_dim, kv_cache_dtype)
        if reason is None:
            return name, passed_over
        passed_over[name] = reason
    raise ValueError("no attention backend can run here: " + "; ".join(f"{name} {reason}"
                                                                       for name, reason in passed_over.items()))


def choose_backend(requested: str, device: str, dtype: torch.dtype, block_size: int, head_dim: int,
                   kv_cache_dtype: torch.dtype | None = None) -> str:
    """`select_backend` on this machine; logs the choice (logger "nanovllm", info)."""
    platform = Platform.probe(device)
    name, passed_over = select_backend(requested, platform, dtype, block_size, head_dim, kv_cache_dtype)
    notes = [f"{other} {reason}" for other, reason in passed_over.items()]
    if device == "cuda" and not platform.installed("triton"):
        notes.append("K/V writes use torch and decode runs without CUDA graphs, since triton is not installed "
                     f"({registry.BACKENDS['triton'].install})")
    logger.info("attention backend: %s%s", name, f" ({'; '.join(notes)})" if notes else "")
    return name
