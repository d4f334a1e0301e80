"""The int8 KV cache's kernels (`kv_cache_dtype="int8"`): each (token, KV head) row stored as 8-bit magnitudes with a
sign bit and the row's float32 scale (`to_cache_dtype`); the compiled CPU store writes the same bytes in its tiles
(K and V: `key_tiles.py`); `paged_decode` over such a cache is attention over its values scaled back, on the unrolled
paths (head_dim 64 and 128) and the runtime one (32), with a window and capped scores too; the torch backend without
the compiled kernels stores and reads rows; flash-attn refuses the cache (Triton reads it: test_kv_cache_8bit.py)."""
import pytest
import torch
from key_tiles import tile_keys, tile_values, untile_keys, untile_values
from test_cpu_kernels import make_case, needs_compiler, reference

from nanovllm.kernels.attention import torch_backend
from nanovllm.kernels.attention.context import Context
from nanovllm.kernels.attention.kv_quant import INT8_CACHE, from_cache, to_cache_dtype
from nanovllm.kernels.attention.selection import Platform, select_backend, unsupported
from nanovllm.kernels.attention.torch_backend import TorchBackend
from nanovllm.kernels.cpu import cpu_kernels, paged_decode

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_a_row_is_its_magnitudes_and_sign_bits_then_its_scale():
    x = torch.tensor([[[254.0, -127.0, 0.5, -0.0, 1.0, 3.0]], [[0.0] * 6]])
    rows = to_cache_dtype(x, INT8_CACHE)
    assert rows.shape == (2, 1, 10) and rows.dtype == torch.uint8
    assert rows[0, 0, :6].tolist() == [127, 0x80 | 64, 0, 0, 0, 2]  # 0.25 of the scale rounds to 0, 1.5 to 2 (even)
    assert rows[:, 0, 6:].clone().view(torch.float32).flatten().tolist() == [2.0, 0.0]
    assert from_cache(rows, torch.float32)[0, 0].tolist() == [254.0, -128.0, 0.0, 0.0, 0.0, 4.0]
    assert not from_cache(rows, torch.float32)[1].any()
    y = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    error = (from_cache(to_cache_dtype(y, INT8_CACHE), torch.float32) - y).abs()
    assert (error <= y.abs().amax(-1, keepdim=True) / 254 * 1.0001).all()  # half a step of each row's scale


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_store_writes_what_torch_stores_in_tiles(dtype):
    k = (torch.randn(40, 2, 32) * torch.logspace(-4, 4, 40)[:, None, None]).to(dtype)
    v = -k.flip(0)
    k[3] = 0
    k_cache, v_cache = torch.zeros(2, 5, 16, 2, 36, dtype=INT8_CACHE)
    slots = torch.randperm(80)[:40]
    slots[::7] = -1
    cpu_kernels().store_kvcache(k, v, k_cache, v_cache, slots)
    valid = slots >= 0
    for cache, x in ((untile_keys(k_cache), k), (untile_values(v_cache), v)):
        assert torch.equal(cache.view(80, 2, 36)[slots[valid]], to_cache_dtype(x[valid], INT8_CACHE))
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[slots[valid]] = False
    assert not untile_keys(k_cache).view(80, 2, 36)[untouched].any()
    with pytest.raises(RuntimeError, match="hold the keys' dtype, 8-bit floats or an int8 cache's bytes"):
        cpu_kernels().store_kvcache(k, v, k_cache[..., :32], v_cache[..., :32], slots)


def int8_case(lengths: list[int], head_dim: int, dtype: torch.dtype):
    """A case of `make_case` with its caches as an int8 cache's rows (values of a wide range of sizes)."""
    q, k_cache, v_cache, tables, lens = make_case(lengths, 16, 4, 2, head_dim, dtype)
    sizes = torch.logspace(-2, 1, k_cache.size(0) * 16).view(-1, 16, 1, 1)
    return q, to_cache_dtype(k_cache * sizes, INT8_CACHE), to_cache_dtype(v_cache * sizes, INT8_CACHE), tables, lens


@needs_compiler
@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_over_an_int8_cache_is_decode_over_its_values(dtype, head_dim):
    q, k8, v8, tables, lens = int8_case([1, 7, 17, 300, 513], head_dim, dtype)
    out = paged_decode(q, tile_keys(k8), tile_values(v8), tables, lens, 0.125)
    assert out.dtype == dtype
    expected = reference(q, from_cache(k8, torch.float64), from_cache(v8, torch.float64), tables, lens, 0.125)
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=tolerance * expected.abs().max().item())
    swapped = paged_decode(q, tile_keys(v8), tile_values(k8), tables, lens, 0.125)
    assert not torch.allclose(swapped, out, atol=0.1), "K and V are read as themselves"


@needs_compiler
def test_decode_over_an_int8_cache_with_a_window_and_capped_scores():
    q, k8, v8, tables, lens = int8_case([1, 17, 300, 513], 64, torch.float32)
    out = paged_decode(q, tile_keys(k8), tile_values(v8), tables, lens, 0.125, 40, 1.5)
    expected = reference(q, from_cache(k8, torch.float64), from_cache(v8, torch.float64), tables, lens, 0.125, 40, 1.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_the_torch_backend_without_compiled_kernels_stores_and_reads_rows(monkeypatch):
    monkeypatch.setattr(torch_backend, "cpu_kernels", lambda: None)
    monkeypatch.setattr(torch_backend, "paged_decode", lambda *args: None)
    k, v = torch.randn(2, 40, 2, 32)
    k_cache, v_cache = torch.zeros(2, 4, 16, 2, 36, dtype=INT8_CACHE)
    slots = torch.arange(40) + 16
    TorchBackend.store_kvcache(k, v, k_cache, v_cache, slots)
    for cache, x in ((k_cache, k), (v_cache, v)):
        assert torch.equal(cache.view(64, 2, 36)[slots], to_cache_dtype(x, INT8_CACHE))
    q = torch.randn(3, 4, 32)
    tables = torch.tensor([[1, 2, 3]] * 2, dtype=torch.int32)
    ctx = Context(max_seqlen_q=2, block_tables=tables, context_lens=torch.tensor([40, 20]),
                  cu_seqlens_q=torch.tensor([0, 2, 3]))  # a prompt's last two rows (gathered), a decode (in place)
    out = TorchBackend.attend(q, k_cache, v_cache, ctx, 0.125)
    expected = reference(q, from_cache(k_cache, torch.float64), from_cache(v_cache, torch.float64), tables[[0, 0, 1]],
                         torch.tensor([39, 40, 20]), 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_backends_that_cannot_read_an_int8_cache_are_passed_over_or_refused():
    gpu = Platform("cuda", (9, 0), lambda name: True)
    assert select_backend("auto", gpu, torch.bfloat16, 256, 128, INT8_CACHE)[0] == "triton"
    assert select_backend("auto", gpu, torch.bfloat16, 256, 128, torch.bfloat16)[0] == "flash-attn"
    without_triton = Platform("cuda", (9, 0), lambda name: name != "triton")
    assert select_backend("auto", without_triton, torch.bfloat16, 256, 128, INT8_CACHE)[0] == "torch"
    for name in ("flash-attn", "flash-attn-4"):
        with pytest.raises(ValueError, match=f"{name} cannot read an int8 KV cache.*attention_backend='triton'"):
            select_backend(name, gpu, torch.bfloat16, 256, 128, INT8_CACHE)
    assert unsupported("torch", Platform("cpu"), torch.float32, 16, 64, INT8_CACHE) is None
    with pytest.raises(ValueError, match="kvcache_block_size must be a multiple of 16, got 8"):
        select_backend("auto", Platform("cpu"), torch.float32, 8, 64, INT8_CACHE)
