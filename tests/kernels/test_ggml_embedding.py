"""Embedding lookups over GGML blocks in the compiled kernels: gguf-py's numpy values, bit for bit."""
import pytest
import torch

from benchmarks.ggml_random import SCALES, random_ggml_weight
from nanovllm.kernels.ggml import BLOCK, TYPE_NAMES, ggml_dequantize, ggml_embedding

pytest.importorskip("gguf")
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.mark.parametrize("dtype", list(BITS), ids=str)
@pytest.mark.parametrize("qtype", BLOCK, ids=TYPE_NAMES.get)
def test_a_lookup_is_gguf_dequantize_bit_for_bit(qtype, dtype):
    """Random blocks, every other one with a negative scale (zeros keep their sign as numpy's do), in each dtype."""
    weight = random_ggml_weight(qtype, 40, 512, seed=qtype)
    if qtype in SCALES:
        blocks = weight.view(-1, BLOCK[qtype][1])
        blocks[::2, SCALES[qtype][0] + 1] |= 0x80
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    out = ggml_embedding(weight, ids, qtype, 512, dtype)
    expected = ggml_dequantize(weight, qtype, 512, dtype)[ids]
    assert out.shape == (2, 3, 512) and out.dtype == dtype
    assert torch.equal(out.view(BITS[dtype]), expected.view(BITS[dtype]))


def test_an_id_outside_the_rows_is_refused():
    weight = random_ggml_weight(8, 4, 64)
    with pytest.raises(RuntimeError, match="id 4 is outside the 4 rows"):
        ggml_embedding(weight, torch.tensor([1, 4]), 8, 64, torch.float32)
