"""Matmuls over weights kept in GGML's quantized block formats (the tensor types of GGUF files).

A quantized weight is a uint8 tensor `[out_features, row_bytes]`: each row is its `in_features` values as GGML blocks
(`BLOCK[qtype]`: values per block, bytes per block), byte for byte as in the GGUF file.

Reference implementation (gguf-py's numpy dequantizer, then a float matmul): the compiled CPU kernels replace it.
"""
import numpy as np
import torch
import torch.nn.functional as F

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


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of `in_features` values of type `qtype`; a ValueError when the row is not whole blocks."""
    values, size = BLOCK[qtype]
    if in_features % values:
        raise ValueError(f"a row of {in_features} values is not a whole number of {values}-value blocks")
    return in_features // values * size


def ggml_dequantize(weight: torch.Tensor, qtype: int, in_features: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix `[rows, in_features]` a quantized weight stands for."""
    from gguf.quants import dequantize

    values = dequantize(weight.cpu().numpy().view(np.uint8), qtype)
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(-1, in_features).to(dtype)


def ggml_linear(x: torch.Tensor, weight: torch.Tensor, qtype: int, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for x `[rows, in_features]` and a quantized W, in x's dtype."""
    return F.linear(x, ggml_dequantize(weight, qtype, in_features, x.dtype), bias)
