"""Attention backends: how K/V are written to the paged cache and how attention reads them.

Every backend has the same two operations:

* `store_kvcache(k, v, k_cache, v_cache, slot_mapping)`: row i of k/v goes to flat slot
  `slot_mapping[i]` of the cache (`block_id * block_size + offset`); slot -1 is skipped.
* `attend(q, k_cache, v_cache, ctx, scale, *, window=0, softcap=0.0)`: causal attention of the step's packed queries
  over the paged cache, for any mix of prefills, prefill chunks over a cached prefix and decodes
  (the one batch shape is described by `nanovllm.kernels.attention.context.Context`), with an optional sliding window
  (a query sees the last `window` positions; blocks before them are never read) and score soft-capping.

Shapes: q `[tokens, heads, head_dim]`, k/v `[tokens, kv_heads, head_dim]`, caches
`[num_blocks, block_size, kv_heads, head_dim]`.

A backend is one module whose class provides `attend` (an `AttentionKernel`), and one `BackendSpec`
row in `BACKENDS` (in `registry`) declaring what it serves: devices, compute capabilities, dtypes, head sizes, block
sizes, whether its attend can be captured in a CUDA graph, the library it needs and how to install it.
`unsupported` and `select_backend` (in `selection`) read only those rows (a pure function of what the machine offers,
see `Platform`), and `load_backend` imports the chosen class and pairs its kernel with a K/V writer,
so `import nanovllm` works without flash-attn or triton. A class may also provide `prepare(device)`, run
when the backend is loaded (the torch backend builds its CPU kernels there, not inside the first step). A CPU
kernel is a row with `devices=("cpu",)`, ahead of torch.
"""
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm.kernels.attention import registry
from nanovllm.kernels.attention.registry import ATTENTION_BACKENDS, AttentionKernel, BackendSpec, importable
from nanovllm.kernels.attention.selection import Platform, choose_backend, select_backend, unsupported
from nanovllm.kernels.attention.torch_backend import TorchBackend

__all__ = ["ATTENTION_BACKENDS", "AttentionKernel", "Backend", "BackendSpec", "Platform", "TORCH", "choose_backend",
           "importable", "load_backend", "select_backend", "unsupported"]


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
    spec = registry.BACKENDS[name]
    module, _, cls = spec.path.partition(":")
    kernel = getattr(importlib.import_module(module), cls)
    if (prepare := getattr(kernel, "prepare", None)) is not None:
        prepare(platform.device)
    if spec.own_kv_writer:
        return Backend(name, kernel.attend, kernel.store_kvcache, spec.capturable)
    if platform.device == "cuda" and platform.installed("triton"):
        from nanovllm.kernels.attention.triton_kv import store_kvcache

        return Backend(f"{name}+triton", kernel.attend, store_kvcache, spec.capturable)
    return Backend(name, kernel.attend, TorchBackend.store_kvcache, False)


TORCH = Backend("torch", TorchBackend.attend, TorchBackend.store_kvcache, False)
"""The torch backend, which every device runs; what an attention layer has until the model runner assigns one."""
