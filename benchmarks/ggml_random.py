"""Random GGML-quantized weights for the GGML kernel benchmark (`benchmarks.ggml_kernels`) and the kernels' tests:
random bytes with sane float16 scales, so every bit pattern of the quantized values occurs while the dequantized
weights stay small."""
import numpy as np
import torch

from nanovllm.kernels.ggml import BLOCK, row_bytes

# byte offsets of each type's float16 scales (d, and dmin / m where the type has one) within a block
SCALES: dict[int, tuple[int, ...]] = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,),
                                      12: (0, 2), 13: (0, 2), 14: (208,)}
FLOAT_TYPES = {0: np.float32, 1: np.float16, 30: None}


def random_ggml_weight(qtype: int, rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A uint8 `[rows, row_bytes]` weight of type `qtype` (values of magnitude ~0.1 or less)."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT_TYPES:
        values = torch.from_numpy(rng.normal(0, 0.05, (rows, in_features)).astype(np.float32))
        dtype = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}[qtype]
        return values.to(dtype).view(torch.uint8).reshape(rows, row_bytes(qtype, in_features))
    values, size = BLOCK[qtype]
    blocks = rng.integers(0, 256, (rows * in_features // values, size), dtype=np.uint8)
    for offset in SCALES[qtype]:
        scale = rng.uniform(0.0005, 0.004, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(rows, row_bytes(qtype, in_features)))
