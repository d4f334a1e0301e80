"""The CPU kernel for an encoder's attention over a step's ragged batch (`csrc/encoder_attention.cpp`): against a
float64 reference (odd lengths, a window shorter and longer than the sequences, grouped heads, head sizes compiled as
constants and not), the strided views ModernBERT passes, rows bitwise the same whatever their batch, and
`bidirectional_attention` reaching it on the CPU."""
import shutil

import pytest
import torch

from nanovllm.kernels.attention.context import reset_context, set_context
from nanovllm.kernels.cpu import cpu_kernels
from nanovllm.models import bert

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: the kernel cannot be built here")

LENGTHS = [1, 2, 7, 16, 17, 63, 64, 65, 129, 150]


def bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def make_case(lengths: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    q = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    k, v = torch.randn(2, rows, kv_heads, head_dim, generator=generator).to(dtype)
    return q, k, v


def reference(q, k, v, cu_seqlens, scale: float, window: int = 0) -> torch.Tensor:
    """float64, one sequence at a time: keys at most `window` positions away (all where 0) masked in, softmax,
    weighted values."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.size(1) // k.size(1)
    edges = cu_seqlens.tolist()
    for start, end in zip(edges, edges[1:]):
        keys, values = (x[start:end].double().repeat_interleave(group, 1) for x in (k, v))
        scores = torch.einsum("ihd,jhd->hij", q[start:end].double(), keys) * scale
        if window:
            rows = torch.arange(end - start)
            scores = scores.masked_fill((rows[:, None] - rows[None, :]).abs() > window, float("-inf"))
        out[start:end] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 32), (4, 2, 64), (2, 1, 80)])
@pytest.mark.parametrize("window", [0, 5, 70])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_attention_against_a_float64_reference(heads, kv_heads, head_dim, window, dtype, atol):
    q, k, v = make_case(LENGTHS, heads, kv_heads, head_dim, dtype)
    cu_seqlens = bounds(LENGTHS)
    out = cpu_kernels().bidirectional_attention(q, k, v, cu_seqlens, head_dim ** -0.5, window)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, cu_seqlens, head_dim ** -0.5, window), atol=atol,
                               rtol=0)


def test_strided_views_give_what_contiguous_tensors_give():
    """ModernBERT's q, k, v are views of one [rows, 3, heads, head_dim] projection; half precision too."""
    lengths = [9, 40, 3]
    qkv = torch.randn(sum(lengths), 3, 4, 32).half()
    q, k, v = qkv.unbind(1)
    kernel = cpu_kernels().bidirectional_attention
    strided = kernel(q, k, v, bounds(lengths), 0.2, 4)
    assert torch.equal(strided, kernel(q.contiguous(), k.contiguous(), v.contiguous(), bounds(lengths), 0.2, 4))
    torch.testing.assert_close(strided.double(), reference(q, k, v, bounds(lengths), 0.2, 4), atol=2e-3, rtol=0)


def test_a_sequence_is_bitwise_the_same_whatever_its_batch_and_thread_count():
    lengths = [150, 1, 33, 64, 65]
    q, k, v = make_case(lengths, 6, 3, 32, torch.bfloat16, seed=1)
    kernel = cpu_kernels().bidirectional_attention
    together = kernel(q, k, v, bounds(lengths), 0.25, 0)
    edges = bounds(lengths).tolist()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for start, end in zip(edges, edges[1:]):
            alone = kernel(q[start:end], k[start:end], v[start:end], bounds([end - start]), 0.25, 0)
            assert torch.equal(alone, together[start:end])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [0, 6])
def test_bidirectional_attention_runs_the_kernel_on_the_cpu(monkeypatch, window):
    """The model's function: the kernel's result where it is built, SDPA's per sequence where it is not."""
    lengths = [5, 20, 11]
    q, k, v = make_case(lengths, 4, 4, 32, torch.float32, seed=2)
    set_context(cu_seqlens_q=bounds(lengths))
    try:
        out = bert.bidirectional_attention(q, k, v, 0.3, window)
        assert torch.equal(out, cpu_kernels().bidirectional_attention(q, k, v, bounds(lengths), 0.3, window))
        monkeypatch.setattr(bert, "cpu_kernels", lambda: None)
        torch.testing.assert_close(bert.bidirectional_attention(q, k, v, 0.3, window), out, atol=2e-6, rtol=0)
    finally:
        reset_context()
