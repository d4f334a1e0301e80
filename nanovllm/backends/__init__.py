"""Attention backends: how K/V are written to the paged cache and how attention reads them.

Every backend has the same two operations:

* `store_kvcache(k, v, k_cache, v_cache, slot_mapping)`: row i of k/v goes to flat slot
  `slot_mapping[i]` of the cache (`block_id * block_size + offset`); slot -1 is skipped.
* `attend(q, k_cache, v_cache, ctx, scale)`: causal attention of the step's packed queries over
  the paged cache, for any mix of prefills, prefill chunks over a cached prefix and decodes
  (the one batch shape is described by `nanovllm.utils.context.Context`).

Shapes: q `[tokens, heads, head_dim]`, k/v `[tokens, kv_heads, head_dim]`, caches
`[num_blocks, block_size, kv_heads, head_dim]`.

A backend's `capturable` says whether its decode step can be captured in a CUDA graph.
`select_backend` decides which backend runs (a pure function of what the machine offers, see
`Platform`) and `load_backend` imports it, so `import nanovllm` works without flash-attn or triton.
"""
import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm.backends.torch_backend import TorchBackend

__all__ = ["ATTENTION_BACKENDS", "Platform", "TorchBackend", "choose_backend", "importable", "load_backend",
           "select_backend", "unsupported"]

logger = logging.getLogger("nanovllm")

ATTENTION_BACKENDS = ("auto", "flash-attn", "flash-attn-4", "triton", "torch")  # "auto" tries them in this order
FLASH_BLOCK_MULTIPLE = 256
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Backend:
    path: str                      # "module:Class", imported only when the backend is chosen
    capturable: bool               # its attend can be captured in a CUDA graph (the K/V write is judged apart)
    library: tuple[str, str | None] = ("torch", None)  # (module, attribute) that must import
    install: str = ""


_BACKENDS = {
    "flash-attn": _Backend("nanovllm.backends.flash_backend:FlashBackend", True,
                           ("flash_attn", "flash_attn_varlen_func"),
                           "pip install 'nanovllm[flash-attn]' (flash-attn 2; it compiles from source where no "
                           "wheel matches your torch)"),
    "flash-attn-4": _Backend("nanovllm.backends.flash4_backend:Flash4Backend", True,
                             ("flash_attn.cute", "flash_attn_varlen_func"),
                             "pip install 'nanovllm[flash-attn-4]' ('nanovllm[flash-attn-4-cu13]' for a CUDA 13 "
                             "torch)"),
    "triton": _Backend("nanovllm.backends.triton_backend:TritonBackend", True, ("triton", None),
                       "pip install 'nanovllm[cuda]'"),
    "torch": _Backend("nanovllm.backends.torch_backend:TorchBackend", False),
}


@functools.cache
def importable(module: str, attribute: str | None = None) -> bool:
    """Whether `module` imports (and has `attribute`): flash-attn 4 installs a bare `flash_attn` namespace
    package, so `import flash_attn` alone does not mean flash-attn 2 is there."""
    try:
        imported = importlib.import_module(module)
    except (ImportError, OSError):
        return False
    return attribute is None or hasattr(imported, attribute)


def library_installed(name: str) -> bool:
    """Whether the library that backend `name` runs on imports here."""
    return importable(*_BACKENDS[name].library)


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


def unsupported(name: str, platform: Platform, dtype: torch.dtype, block_size: int, head_dim: int) -> str | None:
    """Why backend `name` cannot serve this model here, or None when it can. Installation is checked last,
    so that installing is suggested only where it would help."""
    if name == "torch":
        return None
    if platform.device != "cuda":
        if name != "triton":
            return "needs a CUDA GPU"
        if not platform.triton_interpret:
            return "needs a CUDA GPU (or TRITON_INTERPRET=1, to run its kernels in Triton's interpreter on the CPU)"
    elif (reason := _unsupported_on_gpu(name, platform.capability, dtype, block_size, head_dim)) is not None:
        return reason
    if not platform.installed(name):
        return f"is not installed; {_BACKENDS[name].install}"
    return None


def _unsupported_on_gpu(name: str, capability: tuple[int, int], dtype: torch.dtype, block_size: int,
                        head_dim: int) -> str | None:
    gpu = f"this GPU has compute capability {capability[0]}.{capability[1]}"
    if name == "triton":
        if capability < (7, 0):
            return f"needs compute capability 7.0 or newer; {gpu}"
        if capability < (8, 0) and dtype == torch.bfloat16:
            return f"runs bfloat16 from compute capability 8.0 (Ampere) on; {gpu}: use dtype='float16'"
        return None
    if name == "flash-attn" and capability < (8, 0):
        return f"needs compute capability 8.0 (Ampere) or newer; {gpu}"
    if name == "flash-attn-4" and capability[0] not in (9, 10, 11):
        return (f"has a paged KV cache on compute capability 9.x (Hopper) and 10.x/11.x (data-center Blackwell) "
                f"only; {gpu}")
    if dtype not in _HALF:
        return f"runs float16 and bfloat16 only, not {str(dtype).removeprefix('torch.')}"
    max_head_dim = 128 if name == "flash-attn-4" and capability[0] != 9 else 256
    if head_dim % 8 or not 8 <= head_dim <= max_head_dim:
        return f"needs a head_dim that is a multiple of 8 up to {max_head_dim}; this model's is {head_dim}"
    if name == "flash-attn" and block_size % FLASH_BLOCK_MULTIPLE:
        return (f"needs a kvcache_block_size that is a multiple of {FLASH_BLOCK_MULTIPLE}, got {block_size}; use 256 "
                "(the default)")
    return None


def select_backend(requested: str, platform: Platform, dtype: torch.dtype, block_size: int,
                   head_dim: int) -> tuple[str, dict[str, str]]:
    """The backend to run, and for "auto" why each one preferred to it was passed over.

    "auto" is torch on CPU; on CUDA the first of flash-attn (2), flash-attn-4, triton and torch that can
    serve this dtype, block size and head_dim here. A named backend that cannot is a ValueError saying why.
    """
    if requested != "auto":
        reason = unsupported(requested, platform, dtype, block_size, head_dim)
        if reason is not None:
            raise ValueError(f"attention_backend={requested!r} cannot run here: {requested} {reason}")
        return requested, {}
    if platform.device != "cuda":
        return "torch", {}
    passed_over = {}
    for name in ATTENTION_BACKENDS[1:-1]:
        reason = unsupported(name, platform, dtype, block_size, head_dim)
        if reason is None:
            return name, passed_over
        passed_over[name] = reason
    return "torch", passed_over


def choose_backend(requested: str, device: str, dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """`select_backend` on this machine; logs the choice (logger "nanovllm", info)."""
    platform = Platform.probe(device)
    name, passed_over = select_backend(requested, platform, dtype, block_size, head_dim)
    notes = [f"{other} {reason}" for other, reason in passed_over.items()]
    if device == "cuda" and name != "triton" and not platform.installed("triton"):
        notes.append("K/V writes use torch and decode runs without CUDA graphs, since triton is not installed "
                     f"({_BACKENDS['triton'].install})")
    logger.info("attention backend: %s%s", name, f" ({'; '.join(notes)})" if notes else "")
    return name


@functools.cache
def _with_triton_store(base: type, capturable: bool) -> type:
    """`base` with K/V writes done by the Triton kernel, which never syncs with the host."""
    from nanovllm.backends.triton_kv import store_kvcache

    return type(f"{base.__name__}TritonStore", (base,), {"name": f"{base.name}+triton", "capturable": capturable,
                                                         "store_kvcache": staticmethod(store_kvcache)})


def load_backend(name: str, platform: Platform) -> type:
    """Import backend `name` (as chosen by `select_backend`). On CUDA its K/V writes go through the Triton
    kernel whenever triton imports; only then can a backend whose attend is capturable run in CUDA graphs."""
    module, _, cls = _BACKENDS[name].path.partition(":")
    base = getattr(importlib.import_module(module), cls)
    if platform.device != "cuda" or name == "triton" or not platform.installed("triton"):
        return base
    return _with_triton_store(base, _BACKENDS[name].capturable)
