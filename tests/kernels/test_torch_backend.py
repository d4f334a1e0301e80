"""The torch backend's CUDA paths, run on CPU tensors: the batched masked decode, and the store where no compiled
kernel writes the cache. Found on an H100: both failed only there."""
import pytest
import torch
from test_cpu_kernels import make_case, reference

from nanovllm.kernels.attention import torch_backend
from nanovllm.kernels.attention.context import Context
from nanovllm.kernels.attention.kv_quant import to_cache_dtype
from nanovllm.kernels.attention.torch_backend import TorchBackend, _decode_batched


@pytest.mark.parametrize("softcap", [0.0, 1.5])
@pytest.mark.parametrize("window", [0, 20])
def test_batched_decode_ignores_stale_nan_slots_and_gives_padding_rows_zeros(window, softcap):
    """Slots past a row's context hold another request's K/V, possibly inf/NaN; they used to make every row NaN."""
    lengths = [1, 17, 40, 0]  # the last a padding row
    q, k_cache, v_cache, tables, lens = make_case(lengths, 16, 4, 2, 32, torch.float32)
    stale = torch.ones(k_cache.shape[:2], dtype=torch.bool)
    for row, n in enumerate(lengths):
        for i in range(n):
            stale[tables[row, i // 16], i % 16] = False
    k_cache[stale], v_cache[stale] = float("nan"), float("inf")
    out = _decode_batched(q, k_cache, v_cache, Context(block_tables=tables, context_lens=lens), 32 ** -0.5, window,
                          softcap)
    expected = reference(q, k_cache, v_cache, tables, lens, 32 ** -0.5, window, softcap)
    assert out[-1].eq(0).all()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_the_store_without_compiled_kernels_writes_what_torch_converts(cache_dtype, monkeypatch):
    monkeypatch.setattr(torch_backend, "cpu_kernels", lambda: None)
    k = torch.randn(12, 2, 16) * 100
    v = -k
    k_cache, v_cache = torch.zeros(2, 3, 8, 2, 16, dtype=cache_dtype)
    slots = torch.tensor([5, -1, 0, 23, 7, -1, 9, 10, 11, 1, 2, 3])
    TorchBackend.store_kvcache(k, v, k_cache, v_cache, slots)
    valid = slots >= 0
    for cache, x in ((k_cache, k), (v_cache, v)):
        assert torch.equal(cache.view(24, 2, 16)[slots[valid]].view(torch.uint8),
                           to_cache_dtype(x[valid], cache_dtype).view(torch.uint8))
