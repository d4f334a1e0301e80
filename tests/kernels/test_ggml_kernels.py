"""The compiled GGML matmul kernels against gguf-py's numpy dequantizer and a float64 matmul, for every type, on
each path this CPU has (portable C++, AVX2, AVX-512 VNNI); and ggml_quantize against gguf-py's quantizer byte for byte.

The kernels quantize each activation row per 32 values to int8 (x ~ d * q with d = max|x| / 127), so each x_i is
off by at most d / 2: `activation_bound` sums that worst case over a row, |W| * max|x of the block| / 254 (plus
float rounding). With activations that are exactly such int8 blocks (integers, each block's max |x| = 127) there is
no activation error at all, and the kernels must match the float product to float rounding: any wrong bit of a
weight shows.
"""
import shutil

import numpy as np
import pytest
import torch

import nanovllm.kernels.ggml as ggml_ops
from benchmarks.ggml_random import SCALES, random_ggml_weight
from nanovllm.kernels.ggml import (
    BLOCK,
    ISA_ENV,
    REPACKED_UNITS,
    TYPE_NAMES,
    ggml_dequantize,
    ggml_embedding,
    ggml_linear,
    ggml_quantize,
    kernel_isa,
    repack,
    unpack,
)

quantize = pytest.importorskip("gguf.quants").quantize  # gguf-py's reference quantizer: the test extra's

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: the kernels cannot be built here (the reference runs)")
PATHS = {"portable": 0, "avx2": 1, "avx512": 2}
ROWS = (1, 7, 64)
BATCH_ROWS = (1, 3, 4, 5, 8, 13, 64)  # passes of 8 (AVX-512) or 4 (AVX2) rows, tails of 1, 2 and 4
OUT = 37  # odd, not a multiple of the kernels' row tiles


def kernels():
    return ggml_ops.cpu_kernels()


def in_features(qtype: int) -> int:
    """Odd numbers of blocks: 5 blocks of 32, 3 super-blocks of 256, 97 float values."""
    values = BLOCK[qtype][0]
    return {1: 97, 32: 160, 256: 768}[values]


def path(name: str) -> int:
    if PATHS[name] > kernels().ggml_isa():
        pytest.skip(f"this CPU (or the kernels' build) has no {name} path: its best is "
                    f"{next(k for k, v in PATHS.items() if v == kernels().ggml_isa())}")
    return PATHS[name]


def run(x: torch.Tensor, weight: torch.Tensor, qtype: int, isa: int, bias: torch.Tensor | None = None):
    return kernels().ggml_linear(x, weight, qtype, x.shape[-1], bias, isa)


def activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[rows, out] worst-case error of x quantized per 32 values to int8 (round to nearest), plus float rounding."""
    k = x.shape[-1]
    peak = x.abs().reshape(x.shape[0], -1, 32).amax(dim=-1).repeat_interleave(32, dim=-1) if k % 32 == 0 else \
        torch.zeros_like(x)
    return peak.double() @ w.abs().double().T / 254 + 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-6


def int8_blocks(rows: int, k: int, seed: int) -> torch.Tensor:
    """Integers in [-127, 127] with one ±127 in every 32: activations the kernels quantize without error."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (rows, k), generator=g).float()
    x[:, ::32] = 127 * torch.where(torch.rand(rows, k // 32, generator=g) < 0.5, -1.0, 1.0)
    return x


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("qtype", BLOCK, ids=TYPE_NAMES.get)
def test_every_type_matches_gguf_dequantize(qtype, name):
    isa, k = path(name), in_features(qtype)
    weight = random_ggml_weight(qtype, OUT, k, seed=qtype)
    dense = ggml_dequantize(weight, qtype, k).double()
    for rows in ROWS:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        error = (run(x, weight, qtype, isa).double() - x.double() @ dense.T).abs()
        assert (error <= activation_bound(x, dense)).all(), (rows, error.max().item())
        if BLOCK[qtype][0] > 1:
            exact = int8_blocks(rows, k, seed=rows)
            expected = exact.double() @ dense.T
            error = (run(exact, weight, qtype, isa).double() - expected).abs()
            assert (error <= 1e-5 * (exact.abs().double() @ dense.abs().T) + 1e-6).all(), (rows, error.max().item())


@pytest.mark.parametrize("qtype", [q for q in BLOCK if BLOCK[q][0] > 1], ids=TYPE_NAMES.get)
def test_the_bounds_catch_a_corrupted_block(qtype):
    """A block decoded with the wrong quantized bits, or the wrong scale, fails the bounds the tests above use: the
    kernel's output on the good weight is compared with the product over a corrupted one."""
    k = in_features(qtype)
    weight = random_ggml_weight(qtype, OUT, k, seed=qtype)
    values, size = BLOCK[qtype]
    scale_bytes = {o + i for o in SCALES[qtype] for i in (0, 1)}
    quant_bytes = torch.tensor([i not in scale_bytes for i in range(size)])
    x = int8_blocks(7, k, seed=0)
    out = run(x, weight, qtype, kernels().ggml_isa()).double()
    random_x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    random_out = run(random_x, weight, qtype, kernels().ggml_isa()).double()
    for corrupt in ("bits", "scale"):
        bad = weight.clone()
        block = bad[5, size:2 * size]  # the second block of row 5
        if corrupt == "bits":
            block[quant_bytes] ^= 0x5A
        else:
            d = block[SCALES[qtype][0]:SCALES[qtype][0] + 2].view(torch.float16)
            d *= 1.5
        dense = ggml_dequantize(bad, qtype, k).double()
        error = (out[:, 5] - x.double() @ dense[5]).abs()
        assert (error > 1e-5 * (x.abs().double() @ dense[5].abs()) + 1e-6).all(), corrupt
        error = (random_out[:, 5] - random_x.double() @ dense[5]).abs()
        assert (error > activation_bound(random_x, dense)[:, 5]).any(), corrupt


@pytest.mark.parametrize("name", PATHS)
def test_bias_dtypes_and_leading_dimensions(name):
    isa, k = path(name), 96
    weight = random_ggml_weight(3, OUT, k, seed=1)
    dense = ggml_dequantize(weight, 3, k)
    bias = torch.randn(OUT)
    x = torch.randn(2, 3, k)
    out = run(x, weight, 3, isa, bias)
    assert out.shape == (2, 3, OUT) and out.dtype == torch.float32
    assert (out - (x @ dense.T + bias)).abs().max() < 0.05
    for dtype in (torch.bfloat16, torch.float16):
        low = run(x.to(dtype), weight, 3, isa, bias.to(dtype))
        assert low.dtype == dtype
        assert (low.float() - out).abs().max() < 0.05


@pytest.mark.parametrize("name", PATHS)
def test_a_row_does_not_depend_on_its_batch(name):
    """A row's result is bitwise the same however many rows share its call and wherever it sits among them: counts
    that make whole passes of 8 and 4 rows and tails of them, on 70 outputs (whole tiles of 8 and 16 weight rows and a
    partial one), for every type."""
    isa, k = path(name), 768
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(0))
    for qtype in BLOCK:
        weight = random_ggml_weight(qtype, 70, k, seed=3)
        alone = torch.cat([run(x[i:i + 1], weight, qtype, isa) for i in range(len(x))])
        for count in BATCH_ROWS:
            assert torch.equal(run(x[:count], weight, qtype, isa), alone[:count]), (TYPE_NAMES[qtype], count)
            assert torch.equal(run(x[-count:], weight, qtype, isa), alone[-count:]), (TYPE_NAMES[qtype], count)


def test_every_path_computes_the_same_bits():
    """The paths differ only in how they get each chunk's integer dot product, which is exact: the float arithmetic
    around it is the same, so portable C++, AVX2 and AVX-512 agree bit for bit on every quantized type."""
    k, best = 768, kernels().ggml_isa()
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(1))
    for qtype in (q for q in BLOCK if BLOCK[q][0] > 1):
        weight = random_ggml_weight(qtype, 37, k, seed=qtype)
        portable = run(x, weight, qtype, 0)
        for isa in range(1, best + 1):
            assert torch.equal(run(x, weight, qtype, isa), portable), (TYPE_NAMES[qtype], isa)


def test_a_weight_read_in_place_from_a_read_only_buffer_with_padded_rows():
    """As a view of a memory-mapped file can be: rows contiguous but apart, memory not writable."""
    weight = random_ggml_weight(3, OUT, 96, seed=5)
    padded = np.zeros((OUT, weight.shape[1] + 7), dtype=np.uint8)
    padded[:, :weight.shape[1]] = weight.numpy()
    padded.flags.writeable = False
    with pytest.warns(UserWarning, match="not writable"):
        view = torch.from_numpy(padded)[:, :weight.shape[1]]
    x = torch.randn(5, 96)
    assert view.stride(0) == weight.shape[1] + 7
    assert torch.equal(run(x, view, 3, kernels().ggml_isa()), run(x, weight, 3, kernels().ggml_isa()))


def test_bad_weights_are_refused():
    weight = random_ggml_weight(3, 8, 64)
    with pytest.raises(RuntimeError, match="takes 40 bytes"):
        kernels().ggml_linear(torch.randn(1, 64), weight[:, :30], 3, 64, None, 0)
    with pytest.raises(RuntimeError, match="not supported"):
        kernels().ggml_linear(torch.randn(1, 64), weight, 16, 64, None, 0)
    with pytest.raises(RuntimeError, match="features"):
        kernels().ggml_linear(torch.randn(1, 32), weight, 3, 64, None, 0)


@pytest.mark.parametrize("name", ["avx2", "avx512"])
@pytest.mark.parametrize("qtype", REPACKED_UNITS, ids=TYPE_NAMES.get)
def test_weights_repacked_at_load_compute_the_same_bits(qtype, name):
    """Every quantized type in tiles of the path's rows (the file's bytes reordered: `unpack`
    restores them): the same products, bit for bit, for 1 to 16 activation rows in each dtype, and the same embedding
    rows; a tile size the path does not run is refused."""
    isa, k = path(name), in_features(qtype)
    lanes = kernels().ggml_repack_lanes(qtype, isa)
    assert lanes == {1: 8, 2: 16}[isa] and kernels().ggml_repack_lanes(qtype, 0) == 0
    assert kernels().ggml_repack_lanes(1, isa) == 0, "F16 stays as the file has it"
    weight = random_ggml_weight(qtype, 3 * lanes, k, seed=qtype)
    tiles = repack(weight, qtype, lanes)
    assert tiles.shape == weight.shape and not torch.equal(tiles, weight)
    assert torch.equal(unpack(tiles, qtype, lanes), weight)
    bias = torch.randn(3 * lanes)
    for rows in range(1, 17):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        for dtype in (torch.float32, torch.bfloat16):
            expected = run(x.to(dtype), weight, qtype, isa, bias.to(dtype))
            got = kernels().ggml_linear(x.to(dtype), tiles, qtype, k, bias.to(dtype), isa, lanes)
            assert torch.equal(got, expected), (rows, dtype)
    ids = torch.tensor([[0, 3 * lanes - 1], [lanes + 1, 5]])
    assert torch.equal(kernels().ggml_embedding(tiles, ids, qtype, k, torch.float32, lanes),
                       ggml_embedding(weight, ids, qtype, k, torch.float32))
    with pytest.raises(RuntimeError, match="repacked in tiles of 4 rows"):
        kernels().ggml_linear(torch.randn(1, k), tiles, qtype, k, None, isa, 4)
    with pytest.raises(RuntimeError, match="repacked in tiles"):
        kernels().ggml_linear(torch.randn(1, k), tiles[:lanes + 1], qtype, k, None, isa, lanes)


@pytest.mark.parametrize("name", ["portable", "avx2", "avx512"])
def test_a_nan_activation_gives_its_row_nan_and_no_other(name):
    """A NaN in an activation row makes that row's every output NaN, as a float product would, and leaves the rows
    beside it as they are alone; repacked or as the file has them."""
    isa = path(name)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(2))
    x[1, 77] = float("nan")
    for qtype in (3, 8, 12, 14):
        weight = random_ggml_weight(qtype, 32, 768, seed=qtype)
        lanes = kernels().ggml_repack_lanes(qtype, isa)
        for w, tiles in [(weight, 0)] + ([(repack(weight, qtype, lanes), lanes)] if lanes else []):
            for dtype in (torch.float32, torch.bfloat16):
                out = kernels().ggml_linear(x.to(dtype), w, qtype, 768, None, isa, tiles)
                assert out[1].isnan().all(), (TYPE_NAMES[qtype], tiles, dtype)
                rest = kernels().ggml_linear(x[[0, 2, 3, 4]].to(dtype), w, qtype, 768, None, isa, tiles)
                assert torch.equal(out[[0, 2, 3, 4]], rest) and not rest.isnan().any()


@pytest.fixture
def environment(monkeypatch):
    """Set NANOVLLM_CPU_ISA (None: unset) and have `kernel_isa` read it again."""
    def set_isa(name: str | None) -> None:
        if name is None:
            monkeypatch.delenv(ISA_ENV, raising=False)
        else:
            monkeypatch.setenv(ISA_ENV, name)
        kernel_isa.cache_clear()

    yield set_isa
    monkeypatch.delenv(ISA_ENV, raising=False)
    kernel_isa.cache_clear()


def test_the_isa_follows_the_environment(environment):
    best = kernels().ggml_isa()
    environment(None)
    assert kernel_isa() == best
    environment("portable")
    assert kernel_isa() == 0
    environment("avx3")
    with pytest.raises(ValueError, match="avx3"):
        kernel_isa()
    if best < 2:
        environment("avx512")
        with pytest.raises(ValueError, match="only has"):
            kernel_isa()
    environment("avx2" if best >= 1 else "portable")
    weight = random_ggml_weight(8, 16, 64)
    x = torch.randn(3, 64)
    assert torch.equal(ggml_linear(x, weight, 8, 64), run(x, weight, 8, min(best, 1)))


def test_without_the_kernels_the_reference_runs(monkeypatch):
    weight = random_ggml_weight(3, 16, 64)
    x = torch.randn(3, 64)
    monkeypatch.setattr(ggml_ops, "cpu_kernels", lambda: None)
    expected = x @ ggml_dequantize(weight, 3, 64).T
    assert torch.allclose(ggml_linear(x, weight, 3, 64), expected, atol=1e-6)


@pytest.mark.parametrize("qtype", [2, 3, 8], ids=TYPE_NAMES.get)
def test_ggml_quantize_writes_gguf_bytes(qtype):
    g = torch.Generator().manual_seed(qtype)
    w = torch.randn(24, 96, generator=g) * torch.logspace(-3, 1, 24).unsqueeze(1)
    w[0] = 0  # all-zero blocks: scale 0
    w[1, :32] = 0.5  # a constant block
    w[2, :32] = torch.linspace(-1, 1, 32)  # ties between the largest positive and negative values
    w[3, :32] = torch.arange(32) / 127 * 2.5  # values on rounding ties
    expected = quantize(w.numpy(), qtype)
    got = ggml_quantize(w, qtype)
    assert got.dtype == torch.uint8 and got.shape == (24, expected.shape[1])
    assert np.array_equal(got.numpy(), expected)
    low = w.to(torch.bfloat16)
    assert np.array_equal(ggml_quantize(low, qtype).numpy(), quantize(low.float().numpy(), qtype))


def test_ggml_quantize_refuses_what_it_cannot_make():
    with pytest.raises(ValueError, match="Q8_0"):
        ggml_quantize(torch.randn(4, 64), 12)
    with pytest.raises(ValueError, match="whole number"):
        ggml_quantize(torch.randn(4, 40), 8)
    with pytest.raises(ValueError, match="matrix"):
        ggml_quantize(torch.randn(64), 8)
