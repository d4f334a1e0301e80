"""Attention backends: how K/V are written to the paged cache and how attention reads them.

Every backend has the same two operations:

* `store_kvcache(k, v, k_cache, v_cache, slot_mapping)`: row i of k/v goes to flat slot
  `slot_mapping[i]` of the cache (`block_id * block_size + offset`); slot -1 is skipped.
* `attend(q, k_cache, v_cache, ctx, scale)`: causal attention of the step's packed queries over
  the paged cache, for any mix of prefills, prefill chunks over a cached prefix and decodes
  (the one batch shape is described by `nanovllm.utils.context.Context`).

Shapes: q `[tokens, heads, head_dim]`, k/v `[tokens, kv_heads, head_dim]`, caches
`[num_blocks, block_size, kv_heads, head_dim]`.

A backend is one module whose class provides `attend` (an `AttentionKernel`), and one `BackendSpec`
row in `BACKENDS` declaring what it serves: devices, compute capabilities, dtypes, head sizes, block
sizes, whether its attend can be captured in a CUDA graph, the library it needs and how to install it.
`unsupported` and `select_backend` read only those rows (a pure function of what the machine offers,
see `Platform`), and `load_backend` imports the chosen class and pairs its kernel with a K/V writer,
so `import nanovllm` works without flash-attn or triton. A class may also provide `prepare(device)`, run
when the backend is loaded (the torch backend builds its CPU kernels there, not inside the first step). A CPU kernel is a row with
`devices=("cpu",)`, ahead of torch.
"""
import functools
import importlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from nanovllm.backends.torch_backend import TorchBackend
from nanovllm.utils.context import Context

__all__ = ["ATTENTION_BACKENDS", "AttentionKernel", "Backend", "BackendSpec", "BACKENDS", "Platform", "TorchBackend",
           "choose_backend", "importable", "load_backend", "select_backend", "unsupported"]

logger = logging.getLogger("nanovllm")

_HALF = (torch.float16, torch.bfloat16)
_ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AttentionKernel(Protocol):
    """What a backend's class provides: causal attention of a step's queries over the paged cache."""

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context,
               scale: float) -> torch.Tensor: ...


@dataclass(frozen=True)
class BackendSpec:
    """What one backend serves; selection reads nothing else.

    `capability` is the [lowest, past-the-highest) compute capability range on CUDA, `capability_reason` how
    to say it; `bfloat16_from` the capability bfloat16 needs. `head_dim_multiple`/`max_head_dim` bound head
    sizes (`max_head_dim_by_major` per GPU generation), `block_multiple` the KV block size. `capturable`: its
    attend can run in a CUDA graph (which also needs a K/V writer that never syncs: Triton's). `own_kv_writer`:
    its class writes K/V itself; otherwise Triton's writer is used on CUDA when triton imports, else torch's.
    `interpretable`: it also runs on the CPU under TRITON_INTERPRET=1.
    """

    name: str
    path: str                              # "module:Class", imported only when the backend is chosen
    devices: tuple[str, ...] = ("cuda",)
    capability: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (99, 0))
    capability_reason: str = ""
    bfloat16_from: tuple[int, int] = (0, 0)
    dtypes: tuple[torch.dtype, ...] = _ALL_DTYPES
    head_dim_multiple: int = 1
    max_head_dim: int | None = None
    max_head_dim_by_major: Mapping[int, int] = field(default_factory=dict)
    block_multiple: int = 1
    capturable: bool = False
    own_kv_writer: bool = False
    interpretable: bool = False
    library: tuple[str, str | None] | None = None   # (module, attribute) that must import
    install: str = ""


BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in (
    BackendSpec("flash-attn", "nanovllm.backends.flash_backend:FlashBackend",
                capability=((8, 0), (99, 0)), capability_reason="needs compute capability 8.0 (Ampere) or newer",
                dtypes=_HALF, head_dim_multiple=8, max_head_dim=256, block_multiple=256, capturable=True,
                library=("flash_attn", "flash_attn_varlen_func"),
                install="pip install 'nanovllm[flash-attn]' (flash-attn 2; it compiles from source where no wheel "
                        "matches your torch)"),
    BackendSpec("flash-attn-4", "nanovllm.backends.flash4_backend:Flash4Backend",
                capability=((9, 0), (12, 0)),
                capability_reason="has a paged KV cache on compute capability 9.x (Hopper) and 10.x/11.x "
                                  "(data-center Blackwell) only",
                dtypes=_HALF, head_dim_multiple=8, max_head_dim=256, max_head_dim_by_major={10: 128, 11: 128},
                capturable=True, library=("flash_attn.cute", "flash_attn_varlen_func"),
                install="pip install 'nanovllm[flash-attn-4]' ('nanovllm[flash-attn-4-cu13]' for a CUDA 13 torch)"),
    BackendSpec("triton", "nanovllm.backends.triton_backend:TritonBackend",
                capability=((7, 0), (99, 0)), capability_reason="needs compute capability 7.0 or newer",
                bfloat16_from=(8, 0), capturable=True, own_kv_writer=True, interpretable=True,
                library=("triton", None), install="pip install 'nanovllm[cuda]'"),
    BackendSpec("torch", "nanovllm.backends.torch_backend:TorchBackend", devices=("cpu", "cuda"), own_kv_writer=True),
)}
ATTENTION_BACKENDS = ("auto", *BACKENDS)  # "auto" tries them in this order


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
    library = BACKENDS[name].library
    return library is None or importable(*library)


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
    """Why backend `name` cannot serve this model here, or None when it can (from its `BackendSpec`). Installation
    is checked last, so that installing is suggested only where it would help."""
    spec = BACKENDS[name]
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


def select_backend(requested: str, platform: Platform, dtype: torch.dtype, block_size: int,
                   head_dim: int) -> tuple[str, dict[str, str]]:
    """The backend to run, and for "auto" why each one preferred to it was passed over.

    "auto" takes, in `BACKENDS` order, the first backend made for this device (the interpreter does not count)
    that can serve this dtype, block size and head_dim here; torch serves everything. A named backend that
    cannot is a ValueError saying why.
    """
    if requested != "auto":
        reason = unsupported(requested, platform, dtype, block_size, head_dim)
        if reason is not None:
            raise ValueError(f"attention_backend={requested!r} cannot run here: {requested} {reason}")
        return requested, {}
    passed_over = {}
    for name, spec in BACKENDS.items():
        if platform.device not in spec.devices:
            continue
        reason = unsupported(name, platform, dtype, block_size, head_dim)
        if reason is None:
            return name, passed_over
        passed_over[name] = reason
    raise AssertionError("the torch backend serves every device")


def choose_backend(requested: str, device: str, dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """`select_backend` on this machine; logs the choice (logger "nanovllm", info)."""
    platform = Platform.probe(device)
    name, passed_over = select_backend(requested, platform, dtype, block_size, head_dim)
    notes = [f"{other} {reason}" for other, reason in passed_over.items()]
    if device == "cuda" and not platform.installed("triton"):
        notes.append("K/V writes use torch and decode runs without CUDA graphs, since triton is not installed "
                     f"({BACKENDS['triton'].install})")
    logger.info("attention backend: %s%s", name, f" ({'; '.join(notes)})" if notes else "")
    return name


@dataclass(frozen=True)
class Backend:
    """A backend ready to run: its kernel, the K/V writer chosen beside it, and whether decode steps can be
    captured in CUDA graphs (its attend is capturable and its writer never syncs with the host)."""

    name: str
    attend: Callable[..., torch.Tensor]
    store_kvcache: Callable[..., None]
    capturable: bool


def load_backend(name: str, platform: Platform) -> Backend:
    """Import backend `name` (as chosen by `select_backend`) and pair its kernel with a K/V writer: its own, or on
    CUDA Triton's whenever triton imports (the only way a borrowed writer is capturable), else torch's."""
    spec = BACKENDS[name]
    module, _, cls = spec.path.partition(":")
    kernel = getattr(importlib.import_module(module), cls)
    if (prepare := getattr(kernel, "prepare", None)) is not None:
        prepare(platform.device)
    if spec.own_kv_writer:
        return Backend(name, kernel.attend, kernel.store_kvcache, spec.capturable)
    if platform.device == "cuda" and platform.installed("triton"):
        from nanovllm.backends.triton_kv import store_kvcache

        return Backend(f"{name}+triton", kernel.attend, store_kvcache, spec.capturable)
    return Backend(name, kernel.attend, TorchBackend.store_kvcache, False)
