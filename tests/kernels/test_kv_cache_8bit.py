"""The 8-bit KV cache's kernels (`kv_cache_dtype="fp8"`): the compiled CPU store rounds as torch rounds and saturates
(`to_cache_dtype`), K in tiles (`key_tiles.py`); `paged_decode` over an 8-bit cache reads each value back exactly (with
one-hot queries, whose scores are exact in any order of sums, it computes what it computes over the values upcast to
the queries' dtype in rows, bit for bit) and otherwise agrees with that and a float64 reference to rounding (tiled keys
sum their products in another order), on the unrolled paths (head_dim 64 and 128) and the runtime head_dim path (32),
from the first key or from inside a tile (a window); the conversion reads every byte as torch does on each path
`cpu_math.h` compiles (portable, AVX2 with F16C, AVX-512), each built apart; Triton's attention and store under the
interpreter likewise, and over an int8 cache (`kv_8bit_cases.py`)."""
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from interpreted import run_interpreted
from key_tiles import tile_keys, untile_keys
from test_cpu_kernels import make_case, needs_compiler, reference

from nanovllm.kernels.attention.kv_quant import to_cache_dtype
from nanovllm.kernels.attention.selection import Platform, select_backend, unsupported
from nanovllm.kernels.cpu import CSRC, cpu_kernels, paged_decode

CACHES = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def every_finite_value(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A cache of `shape` drawn from every finite value of the 8-bit `dtype` (subnormals and the largest included)."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype)
    values = values[values.float().isfinite()]
    return values[torch.randint(len(values), shape, generator=torch.Generator().manual_seed(seed))]


def test_to_cache_dtype_saturates_and_keeps_its_own_dtype():
    x = torch.tensor([1e6, -1e6, 0.3, 1e-9])
    for dtype in CACHES:
        stored = to_cache_dtype(x, dtype)
        assert stored.float()[:2].tolist() == [torch.finfo(dtype).max, -torch.finfo(dtype).max]
        assert torch.equal(stored[2:], x[2:].to(dtype))
    assert to_cache_dtype(x, torch.float32) is x


@needs_compiler
@pytest.mark.parametrize("cache_dtype", CACHES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_store_writes_what_torch_converts(dtype, cache_dtype):
    k = (torch.randn(40, 2, 32) * torch.logspace(-4, 5, 40)[:, None, None]).to(dtype)  # subnormals to saturation
    v = -k.flip(0)
    k_cache, v_cache = torch.zeros(2, 5, 16, 2, 32, dtype=cache_dtype)
    slots = torch.randperm(80)[:40]
    slots[::7] = -1
    cpu_kernels().store_kvcache(k, v, k_cache, v_cache, slots)
    valid = slots >= 0
    for cache, x in ((untile_keys(k_cache), k), (v_cache, v)):
        assert torch.equal(cache.view(80, 2, 32)[slots[valid]].view(torch.uint8),
                           to_cache_dtype(x[valid], cache_dtype).view(torch.uint8))
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[slots[valid]] = False
    assert not untile_keys(k_cache).view(80, 2, 32)[untouched].view(torch.uint8).any()


@needs_compiler
def test_an_8bit_cache_whose_blocks_cannot_hold_whole_key_tiles_is_refused():
    k = torch.randn(4, 2, 32)
    k_cache, v_cache = torch.zeros(2, 5, 8, 2, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="tiles of 16 tokens: its blocks must hold a multiple of 16 tokens, not 8"):
        cpu_kernels().store_kvcache(k, k, k_cache, v_cache, torch.arange(4))
    with pytest.raises(ValueError, match="kvcache_block_size must be a multiple of 16, got 8"):
        select_backend("auto", Platform("cpu"), torch.float32, 8, 64, torch.float8_e4m3fn)


@needs_compiler
@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize("cache_dtype", CACHES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_over_an_8bit_cache_is_decode_over_its_values_upcast(dtype, cache_dtype, head_dim):
    q, k_cache, _, tables, lens = make_case([1, 7, 17, 300, 513], 16, 4, 2, head_dim, dtype)
    k8, v8 = every_finite_value(cache_dtype, k_cache.shape, 1), every_finite_value(cache_dtype, k_cache.shape, 2)
    scale = 0.001  # the largest values (448, 57344) would otherwise leave one key per row
    tiled, upcast = tile_keys(k8), (k8.to(dtype), v8.to(dtype))
    out = paged_decode(q, tiled, v8, tables, lens, scale)
    assert out.dtype == dtype
    rows = q.size(0) * q.size(1)
    for offset in range(0, head_dim, rows):  # every value of every key scored alone
        one_hot = torch.zeros(rows, head_dim, dtype=dtype)
        one_hot[torch.arange(rows), (torch.arange(rows) + offset) % head_dim] = 1
        one_hot = one_hot.view(q.shape)
        assert torch.equal(paged_decode(one_hot, tiled, v8, tables, lens, scale),
                           paged_decode(one_hot, *upcast, tables, lens, scale)), offset
    expected = reference(q, k8.double(), v8.double(), tables, lens, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # of the largest output (values reach 448 and 57344)
    atol = tolerance * expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol)
    torch.testing.assert_close(out.double(), paged_decode(q, *upcast, tables, lens, scale).double(), rtol=0,
                               atol=atol)


@needs_compiler
def test_decode_over_an_8bit_cache_with_a_window_and_capped_scores():
    q, k_cache, v_cache, tables, lens = make_case([1, 17, 300, 513], 16, 4, 2, 64, torch.float32)
    k8, v8 = (to_cache_dtype(c, torch.float8_e4m3fn) for c in (k_cache, v_cache))
    out = paged_decode(q, tile_keys(k8), v8, tables, lens, 0.125, 40, 1.5)
    torch.testing.assert_close(out, paged_decode(q, k8.float(), v8.float(), tables, lens, 0.125, 40, 1.5), atol=1e-6,
                               rtol=0)
    torch.testing.assert_close(out.double(), reference(q, k8.double(), v8.double(), tables, lens, 0.125, 40, 1.5),
                               atol=1e-5, rtol=0)


CONVERSION_PROGRAM = r"""
#include <cstdio>
#include "cpu_math.h"
template <typename C>
void show(int offset) {  // every byte, from an unaligned start, through to_floats' vector loops and its tail
  C in[264];
  float out[264];
  for (int i = 0; i < 256; ++i) in[i + offset].x = static_cast<uint8_t>(i);
  to_floats(in + offset, out, 256);
  to_floats(in + offset + 250, out + 250, 6);
  for (int i = 0; i < 256; ++i) std::printf("%a ", out[i]);
  std::printf("\n");
}
int main() { show<c10::Float8_e4m3fn>(3); show<c10::Float8_e5m2>(5); }
"""
ISA_PATHS = {"portable": ("-march=x86-64", ()), "avx2": ("-march=x86-64-v3", ("avx2", "f16c")),
             "avx512": ("-march=x86-64-v4", ("avx512f", "avx512bw"))}


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None, reason="x86-64 paths, g++")
@pytest.mark.parametrize("path", ISA_PATHS)
def test_each_cpu_path_reads_every_8bit_value_as_torch_does(path, tmp_path):
    march, needs = ISA_PATHS[path]
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    if not set(needs) <= set(flags):
        pytest.skip(f"this CPU has no {path}")
    source = tmp_path / "convert.cpp"
    source.write_text(CONVERSION_PROGRAM)
    include = Path(torch.__file__).parent / "include"
    subprocess.run(["g++", "-O3", "-std=c++17", march, "-w", f"-I{include}", f"-I{CSRC}", str(source), "-o",
                    str(tmp_path / "convert")], check=True)
    lines = subprocess.run([str(tmp_path / "convert")], capture_output=True, text=True, check=True).stdout.splitlines()
    for dtype, line in zip(CACHES, lines):
        got = torch.tensor([float.fromhex(x) for x in line.split()])
        expected = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        finite = expected.isfinite()  # NaN and infinity are never stored (saturated)
        assert torch.equal(got[finite], expected[finite]), path
        assert torch.equal(got.view(torch.int32)[finite], expected.view(torch.int32)[finite]), "signed zeros"


def test_backends_that_cannot_read_an_8bit_cache_are_passed_over_or_refused():
    gpu = Platform("cuda", (9, 0), lambda name: True)
    assert select_backend("auto", gpu, torch.bfloat16, 256, 128, torch.float8_e4m3fn)[0] == "triton"
    assert select_backend("auto", gpu, torch.bfloat16, 256, 128, torch.bfloat16)[0] == "flash-attn"
    with pytest.raises(ValueError, match="flash-attn cannot read an 8-bit KV cache.*kv_cache_dtype='auto'"):
        select_backend("flash-attn", gpu, torch.bfloat16, 256, 128, torch.float8_e5m2)
    assert unsupported("torch", Platform("cpu"), torch.float32, 16, 64, torch.float8_e4m3fn) is None


@pytest.fixture(scope="module", params=["interpreted", pytest.param("cuda", marks=pytest.mark.cuda)])
def interpreted(request) -> dict:
    """The cases under Triton's interpreter on the CPU, and compiled on a GPU."""
    pytest.importorskip("triton")
    if request.param == "cuda":
        from kv_8bit_cases import cases
        return cases("cuda")
    return run_interpreted("kv_8bit_cases.py", timeout=600)


def test_triton_attention_over_an_8bit_cache_is_attention_over_its_values_upcast(interpreted):
    for name, result in interpreted["attention"].items():
        if "/int8/" in name:
            continue
        assert result["triton_exact"], name
        tolerance = 0.07 if "bfloat16" in name else 1e-5
        assert result["error_vs_torch"] <= tolerance and result["torch_error"] <= tolerance, (name, result)


def test_triton_attention_over_an_int8_cache_is_attention_over_its_values(interpreted):
    int8 = {name: result for name, result in interpreted["attention"].items() if "/int8/" in name}
    assert len(int8) == 6  # float32 with head_dim 16 and 18 (its rows' scales not 4-byte aligned), bfloat16 with 16
    for name, result in int8.items():
        tolerance = 0.1 if "bfloat16" in name else 1e-5  # bfloat16: under two steps of the outputs (up to ~12)
        assert result["error_vs_values"] <= tolerance and result["error_vs_torch"] <= tolerance, (name, result)


def test_triton_store_writes_what_torch_converts(interpreted):
    assert all(interpreted["store"].values()), interpreted["store"]
