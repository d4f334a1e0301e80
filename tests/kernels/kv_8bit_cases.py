"""Triton's readers and writer of an 8-bit KV cache under TRITON_INTERPRET=1 (run by test_kv_cache_8bit.py in a fresh
interpreter; it prints its results as JSON): attention over an 8-bit cache is bitwise attention over the same values
upcast (every 8-bit float is a float32, float16 and bfloat16 value), for decodes (split keys) and mixed steps, with
the torch backend as the reference (over its 8-bit cache, K tiled on the CPU: the same to rounding); attention over an
int8 cache is, to rounding, attention over its values scaled back (the torch backend in float32 over them) and the
torch backend's over the same cache; the store writes what `to_cache_dtype` makes, byte for byte. On a GPU,
test_kv_cache_8bit.py runs the same cases compiled (`cases("cuda")`)."""
import json

import torch
from key_tiles import as_torch_backend_keeps, tile_values
from triton_attention_cases import PAD, Batch, make_batch

from nanovllm.kernels.attention.kv_quant import INT8_CACHE, from_cache, to_cache_dtype
from nanovllm.kernels.attention.torch_backend import TorchBackend
from nanovllm.kernels.attention.triton_backend import TritonBackend

STEPS = {"decode": [(1, 700, 1), (1, 33, 2), PAD], "mixed": [(5, 40, 3), (1, 300, 4), (20, 20, 5)]}
CACHES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
STORES = {**CACHES, "int8": INT8_CACHE}


def attend(backend, batch, k_cache, v_cache) -> torch.Tensor:
    return backend.attend(batch.q, k_cache, v_cache, batch.ctx, batch.scale)


def cases(device: str) -> dict:
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for step, seqs in STEPS.items():
            batch = make_batch(seqs, dtype=dtype, device=device)
            for name, cache_dtype in CACHES.items():
                k8, v8 = (to_cache_dtype(c * 4, cache_dtype) for c in (batch.k_cache, batch.v_cache))
                upcast = k8.to(dtype), v8.to(dtype)
                out = attend(TritonBackend, batch, k8, v8)
                torch_out = attend(TorchBackend, batch, as_torch_backend_keeps(k8), v8).float()
                results[f"{dtype}/{step}/{name}"] = {
                    "triton_exact": torch.equal(out, attend(TritonBackend, batch, *upcast)),
                    "torch_error": (torch_out - attend(TorchBackend, batch, *upcast).float()).abs().max().item(),
                    "error_vs_torch": (out.float() - torch_out).abs().max().item()}
            for head_dim in (16, 18) if dtype == torch.float32 else (16,):  # 18: scales not 4-byte aligned
                batch = make_batch(seqs, dtype=dtype, device=device, head_dim=head_dim)
                k8, v8 = (to_cache_dtype(c * 4, INT8_CACHE) for c in (batch.k_cache, batch.v_cache))
                out = attend(TritonBackend, batch, k8, v8).float()
                values = Batch(batch.q.float(), from_cache(k8, torch.float32), from_cache(v8, torch.float32),
                               batch.ctx, batch.rows, batch.scale)
                scaled_back = attend(TorchBackend, values, values.k_cache, values.v_cache)
                tiled = as_torch_backend_keeps(k8)
                torch_out = attend(TorchBackend, batch, tiled, v8 if tiled is k8 else tile_values(v8)).float()
                results[f"{dtype}/{step}/int8/head_dim {head_dim}"] = {
                    "error_vs_values": (out - scaled_back).abs().max().item(),
                    "error_vs_torch": (out - torch_out).abs().max().item()}
    stores = {}
    for name, cache_dtype in STORES.items():
        k = (torch.randn(40, 2, 16) * torch.logspace(-4, 5, 40)[:, None, None]).to(device)  # subnormals to past max
        v = -k
        k_cache, v_cache = torch.zeros(2, 5, 16, 2, 16 + 4 * (cache_dtype == INT8_CACHE), dtype=cache_dtype,
                                       device=device)
        slots = torch.randperm(80)[:40].to(device)
        slots[::7] = -1
        TritonBackend.store_kvcache(k, v, k_cache, v_cache, slots)
        valid = slots >= 0
        stores[name] = all(torch.equal(cache.view(80, 2, -1)[slots[valid]].view(torch.uint8),
                                       to_cache_dtype(x[valid], cache_dtype).view(torch.uint8))
                           for cache, x in ((k_cache, k), (v_cache, v)))
    return {"attention": results, "store": stores}


if __name__ == "__main__":
    print(json.dumps(cases("cpu")))
