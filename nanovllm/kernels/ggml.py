"""Matmuls over weights kept in GGML's quantized block formats (the tensor types of GGUF files).

A quantized weight is a uint8 tensor `[out_features, row_bytes]`: each row is its `in_features` values as GGML blocks
(`BLOCK[qtype]`: values per block, bytes per block), byte for byte as in the GGUF file (a view of a memory-mapped
file does: the kernels only read it, and need only each row contiguous).

On the CPU `ggml_linear` runs the compiled kernels (`kernels/csrc/ggml_quant.cpp`): each activation row quantized
per 32 values to int8, then integer dot products per block, as llama.cpp computes them. The path follows what the CPU
reports: AVX-512 (VNNI) where present, else AVX2, else portable C++; `NANOVLLM_CPU_ISA=avx2` (or `portable`),
read at the first call, forces a lower one, e.g. to test the AVX2 path on an AVX-512 machine. Elsewhere, or without
the compiled kernels, the reference runs: gguf-py's numpy dequantizer, then a float matmul.

Weights of every quantized type can be repacked once, at load, as llama.cpp's CPU backend repacks them: `repack`
reorders the bytes of each tile of `repack_lanes(qtype)` rows (16 on AVX-512, 8 on AVX2) into the order the kernel
streams them, so that no call unpacks or transposes them again (`RepackedLayout` and its K-quant kin in the kernels);
`unpack` restores the file's order.
"""
import functools
import os

import numpy as np
import torch
import torch.nn.functional as F

from nanovllm.kernels.cpu import cpu_kernels

# GGML type id: (values per block, bytes per block)
BLOCK: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    30: (1, 2),  # BF16
}
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
TYPE_IDS = {name: qtype for qtype, name in TYPE_NAMES.items()}
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGML type id: torch dtype
Q4_0, Q4_1, Q8_0 = TYPE_IDS["Q4_0"], TYPE_IDS["Q4_1"], TYPE_IDS["Q8_0"]

ISA_ENV = "NANOVLLM_CPU_ISA"
ISAS = {"portable": 0, "avx2": 1, "avx512": 2}  # the compiled kernels' path ids


def type_name(qtype: int) -> str:
    return TYPE_NAMES.get(qtype, f"GGML type {qtype}")


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of `in_features` values of type `qtype`; a ValueError when the row is not whole blocks."""
    values, size = BLOCK[qtype]
    if in_features % values:
        raise ValueError(f"a row of {in_features} values is not a whole number of {values}-value blocks")
    return in_features // values * size


@functools.cache
def kernel_isa() -> int:
    """The compiled kernels' path to run: the best this CPU has, or the one `NANOVLLM_CPU_ISA` names (read once;
    `kernel_isa.cache_clear()` reads it again)."""
    best = cpu_kernels().ggml_isa()
    name = os.environ.get(ISA_ENV, "").strip().lower()
    if not name:
        return best
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV}={name!r} is not one of {', '.join(ISAS)}")
    if ISAS[name] > best:
        raise ValueError(f"{ISA_ENV}={name} but this CPU (or the kernels' build) only has "
                         f"{next(k for k, v in ISAS.items() if v == best)}")
    return ISAS[name]


def ggml_dequantize(weight: torch.Tensor, qtype: int, in_features: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix `[rows, in_features]` a quantized weight stands for."""
    from gguf.quants import dequantize

    values = dequantize(weight.cpu().numpy().view(np.uint8), qtype)
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(-1, in_features).to(dtype)


def ggml_linear(x: torch.Tensor, weight: torch.Tensor, qtype: int, in_features: int,
                bias: torch.Tensor | None = None, lanes: int = 0) -> torch.Tensor:
    """`x @ W.T + bias` for x `[..., in_features]` and a quantized W (repacked in tiles of `lanes` rows, or not: 0),
    in x's dtype."""
    kernels = cpu_kernels()
    if kernels is not None and x.device.type == "cpu":
        return kernels.ggml_linear(x, weight, qtype, in_features, bias, kernel_isa(), lanes)
    weight = unpack(weight, qtype, lanes) if lanes else weight
    return F.linear(x, ggml_dequantize(weight, qtype, in_features, x.dtype).to(x.device), bias)


def repack_lanes(qtype: int) -> int:
    """The rows of a tile that `repack` puts weights of `qtype` in for the kernels' path, or 0 where the kernels run
    them as the file has them (other types, the portable path, no compiled kernels)."""
    kernels = cpu_kernels()
    return kernels.ggml_repack_lanes(qtype, kernel_isa()) if kernels is not None else 0


# GGML type id: (first byte, bytes) of the part of a block that `repack` lays out in 4-byte units (its values; a
# K-quant's whole block but a last half float), for the types it takes; the rest follows in 2-byte units
REPACKED_UNITS = {TYPE_IDS[name]: units for name, units in [
    ("Q4_0", (2, 16)), ("Q4_1", (4, 16)), ("Q5_0", (2, 20)), ("Q5_1", (4, 20)), ("Q8_0", (2, 32)), ("Q4_K", (0, 144)),
    ("Q2_K", (0, 84)), ("Q3_K", (0, 108)), ("Q5_K", (0, 176)), ("Q6_K", (0, 208))]}


def repack(data: torch.Tensor, qtype: int, lanes: int) -> torch.Tensor:
    """Blocks `[rows, row_bytes]` (rows a multiple of `lanes`) reordered as tiles of `lanes` rows, in place of those
    rows: per block, its `REPACKED_UNITS` bytes of every row in 4-byte units (unit 0 of each row, then unit 1, ...),
    then the rest of the block (each row's half-float scale, then offset) in 2-byte units alike. The same bytes and
    shape."""
    start, length = REPACKED_UNITS[qtype]
    size = BLOCK[qtype][1]
    rows, row_bytes = data.shape
    blocks = data.view(rows // lanes, lanes, row_bytes // size, size).transpose(1, 2)  # tile, block, lane, byte
    units = blocks[..., start:start + length].unflatten(-1, (length // 4, 4)).transpose(2, 3)  # tile, block, unit, lane
    rest = torch.cat([blocks[..., :start], blocks[..., start + length:]], dim=-1)
    rest = rest.unflatten(-1, ((size - length) // 2, 2)).transpose(2, 3)
    return torch.cat([units.flatten(2), rest.flatten(2)], dim=2).reshape(rows, row_bytes)


def unpack(data: torch.Tensor, qtype: int, lanes: int) -> torch.Tensor:
    """`repack`'s tiles back in the file's order."""
    start, length = REPACKED_UNITS[qtype]
    size = BLOCK[qtype][1]
    rows, row_bytes = data.shape
    tiles = data.reshape(rows // lanes, row_bytes // size, lanes * size)  # tile, block, bytes of the repacked block
    # tile, block, lane, then its bytes of units (or of the rest)
    units = tiles[..., :length * lanes].unflatten(-1, (length // 4, lanes, 4)).transpose(2, 3).flatten(3)
    rest = tiles[..., length * lanes:].unflatten(-1, ((size - length) // 2, lanes, 2)).transpose(2, 3).flatten(3)
    blocks = torch.cat([rest[..., :start], units, rest[..., start:]], dim=3)  # tile, block, lane, byte
    return blocks.transpose(1, 2).reshape(rows, row_bytes)


def ggml_embedding(weight: torch.Tensor, ids: torch.Tensor, qtype: int, in_features: int,
                   dtype: torch.dtype, lanes: int = 0) -> torch.Tensor:
    """Rows `ids` of a quantized weight (repacked in tiles of `lanes` rows, or not: 0), dequantized to `dtype` (an
    embedding lookup `[*ids.shape, in_features]`): gguf-py's values, rounded to `dtype`; on the CPU in the compiled
    kernels, without numpy's per-call overhead."""
    kernels = cpu_kernels()
    if kernels is not None and weight.device.type == "cpu":
        return kernels.ggml_embedding(weight, ids, qtype, in_features, dtype, lanes)
    weight = unpack(weight, qtype, lanes) if lanes else weight
    rows = weight.index_select(0, ids.flatten())
    return ggml_dequantize(rows, qtype, in_features, dtype).view(*ids.shape, in_features)


def ggml_quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """A float matrix `[N, K]` as GGML blocks of `qtype` (Q8_0, Q4_0 or Q4_1), round-to-nearest: the uint8
    `[N, row_bytes]` that `ggml_linear` takes, the bytes gguf-py's `gguf.quants.quantize` writes."""
    if qtype not in (Q8_0, Q4_0, Q4_1):
        raise ValueError(f"ggml_quantize makes Q8_0 ({Q8_0}), Q4_0 ({Q4_0}) or Q4_1 ({Q4_1}) blocks, not type {qtype}")
    if weight.dim() != 2:
        raise ValueError(f"ggml_quantize takes a [N, K] matrix, not a tensor of shape {tuple(weight.shape)}")
    n, k = weight.shape
    size = row_bytes(qtype, k)
    blocks = weight.detach().to(device="cpu", dtype=torch.float32).reshape(-1, 32)
    if qtype == Q8_0:
        d = blocks.abs().amax(dim=1, keepdim=True) / 127
        q = _round_half_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
        parts = [d]
    else:
        if qtype == Q4_0:
            peak = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
            d = peak / -8
            q = torch.trunc(blocks * _inverse(d) + 8.5)
            parts = [d]
        else:
            low, high = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
            d = (high - low) / 15
            q = torch.trunc((blocks - low) * _inverse(d) + 0.5)
            parts = [d, low]
        q = q.clamp(0, 15).to(torch.uint8)
        q = q[:, :16] | (q[:, 16:] << 4)
    scales = [p.to(torch.float16).view(torch.uint8) for p in parts]
    return torch.cat([*scales, q], dim=1).reshape(n, size)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, in gguf-py's arithmetic (`np_roundf`)."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())
