"""The attention backends nanovllm knows, one `BackendSpec` row each: what the backend serves and what it needs.

Selection (`nanovllm.kernels.attention.selection`) reads nothing else, so it is a pure function of these rows and
what the machine offers.
"""
import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from nanovllm.kernels.attention.context import Context

_HALF = (torch.float16, torch.bfloat16)
_ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AttentionKernel(Protocol):
    """What a backend's class provides: causal attention of a step's queries over the paged cache; `window` > 0: each
    query sees only the last `window` positions (itself included); `softcap` > 0: scores capped by
    softcap * tanh(score / softcap)."""

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float, *,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor: ...


@dataclass(frozen=True)
class BackendSpec:
    """What one backend serves; selection reads nothing else.

    `capability` is the [lowest, past-the-highest) compute capability range on CUDA, `capability_reason` how
    to say it; `bfloat16_from` the capability bfloat16 needs. `head_dim_multiple`/`max_head_dim` bound head
    sizes (`max_head_dim_by_major` per GPU generation), `block_multiple` the KV block size. `capturable`: its
    attend can run in a CUDA graph (which also needs a K/V writer that never syncs: Triton's). `own_kv_writer`:
    its class writes K/V itself; otherwise Triton's writer is used on CUDA when triton imports, else torch's.
    `interpretable`: it also runs on the CPU under TRITON_INTERPRET=1. `reads_8bit_cache`: it serves a KV cache of
    8-bit floats (`kv_cache_dtype="fp8"`), reading each value back exactly; `reads_int8_cache`: one of scaled 8-bit
    integers (`kv_cache_dtype="int8"`); `cpu_8bit_block_multiple`: the block size an 8-bit cache needs on the CPU (the
    compiled kernels keep its K in tiles of 16 tokens).
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
    reads_8bit_cache: bool = False
    reads_int8_cache: bool = False
    cpu_8bit_block_multiple: int = 1
    library: tuple[str, str | None] | None = None   # (module, attribute) that must import
    install: str = ""


BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in (
    BackendSpec("flash-attn", "nanovllm.kernels.attention.flash_backend:FlashBackend",
                capability=((8, 0), (99, 0)), capability_reason="needs compute capability 8.0 (Ampere) or newer",
                dtypes=_HALF, head_dim_multiple=8, max_head_dim=256, block_multiple=256, capturable=True,
                library=("flash_attn", "flash_attn_varlen_func"),
                install="pip install 'nanovllm[flash-attn]' (flash-attn 2; it compiles from source where no wheel "
                        "matches your torch)"),
    BackendSpec("flash-attn-4", "nanovllm.kernels.attention.flash4_backend:Flash4Backend",
                capability=((9, 0), (12, 0)),
                capability_reason="has a paged KV cache on compute capability 9.x (Hopper) and 10.x/11.x "
                                  "(data-center Blackwell) only",
                dtypes=_HALF, head_dim_multiple=8, max_head_dim=256, max_head_dim_by_major={10: 128, 11: 128},
                capturable=True, library=("flash_attn.cute", "flash_attn_varlen_func"),
                install="pip install 'nanovllm[flash-attn-4]' ('nanovllm[flash-attn-4-cu13]' for a CUDA 13 torch)"),
    BackendSpec("triton", "nanovllm.kernels.attention.triton_backend:TritonBackend",
                capability=((7, 0), (99, 0)), capability_reason="needs compute capability 7.0 or newer",
                bfloat16_from=(8, 0), capturable=True, own_kv_writer=True, interpretable=True,
                reads_8bit_cache=True, reads_int8_cache=True, library=("triton", None),
                install="pip install 'nanovllm[cuda]'"),
    BackendSpec("torch", "nanovllm.kernels.attention.torch_backend:TorchBackend", devices=("cpu", "cuda"),
                own_kv_writer=True, reads_8bit_cache=True, reads_int8_cache=True, cpu_8bit_block_multiple=16),
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


