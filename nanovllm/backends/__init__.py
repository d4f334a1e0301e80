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
`select_backend` picks one once, at start-up; flash-attn and triton are imported only when
chosen, so `import nanovllm` works without them.
"""
import functools
import importlib
import warnings

import torch

from nanovllm.backends.torch_backend import TorchBackend

__all__ = ["TorchBackend", "choose_backend", "importable", "select_backend"]

FLASH_BLOCK_MULTIPLE = 256
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_INSTALL_HINT = "install the CUDA extras with `pip install nanovllm[cuda]`"


@functools.cache
def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.cache
def _with_triton_store(base: type, capturable: bool) -> type:
    """`base` with K/V writes done by the Triton kernel, which never syncs with the host."""
    from nanovllm.backends.triton_kv import store_kvcache

    return type(f"{base.__name__}TritonStore", (base,), {"name": f"{base.name}+triton", "capturable": capturable,
                                                         "store_kvcache": staticmethod(store_kvcache)})


def select_backend(device: str, dtype: torch.dtype, block_size: int, *, has_flash_attn: bool,
                   has_triton: bool) -> type:
    """The attention backend for this device, dtype and what imports; pure apart from one-time warnings.

    CPU: the torch backend. CUDA: flash-attn when it is installed and the dtype is float16 or
    bfloat16 (then `block_size` must be a multiple of 256), else the torch backend with a warning.
    On CUDA, K/V writes use the Triton kernel when triton is installed. Only flash-attn with the
    Triton writer is `capturable`: the torch decode gathers whole block tables, and a graph would
    have to hold that for the largest batch at full length.
    """
    if device != "cuda":
        return TorchBackend
    use_flash = has_flash_attn and dtype in _FLASH_DTYPES
    if not has_flash_attn:
        _warn_once("flash-attn is not installed: attention runs on the slower torch backend, without CUDA "
                   f"graphs; {_INSTALL_HINT}")
    elif not use_flash:
        _warn_once(f"flash-attn does not support {dtype}: attention runs on the slower torch backend, without "
                   "CUDA graphs; use dtype='bfloat16' or 'float16' for the flash-attn path")
    elif block_size % FLASH_BLOCK_MULTIPLE:
        raise ValueError(
            f"kvcache_block_size={block_size} does not work with flash-attn's paged KV cache, which needs a "
            f"multiple of {FLASH_BLOCK_MULTIPLE}; use kvcache_block_size=256 (the default) or a multiple of it"
        )
    if use_flash:
        from nanovllm.backends.flash_backend import FlashBackend

        base = FlashBackend
    else:
        base = TorchBackend
    if not has_triton:
        _warn_once(f"triton is not installed: K/V cache writes use torch and decode runs without CUDA graphs; "
                   f"{_INSTALL_HINT}")
        return base
    return _with_triton_store(base, capturable=use_flash)


def choose_backend(device: str, dtype: torch.dtype, block_size: int) -> type:
    """`select_backend` with what actually imports here; probes flash-attn and triton only on CUDA."""
    if device != "cuda":
        return TorchBackend
    return select_backend(device, dtype, block_size, has_flash_attn=importable("flash_attn"),
                          has_triton=importable("triton"))
