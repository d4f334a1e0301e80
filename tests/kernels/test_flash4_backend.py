"""The flash-attn 4 adapter's side of the contract, on CPU: a stand-in for `flash_attn.cute` that enforces what
flash-attn 4's `flash_attn_varlen_func` asserts (paged KV via `page_table` + `seqused_k`, never with
`cu_seqlens_k`; int32 tables and lengths; float16/bfloat16) and computes what it documents. The kernel itself
is tested against a float64 reference on a GPU (test_cuda.py)."""
import sys
import types

import pytest
import torch
from test_cpu_fast_path import naive_attention

from nanovllm.kernels.attention.context import Context
from nanovllm.kernels.attention.flash4_backend import Flash4Backend


def fake_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, seqused_k=None, page_table=None,
                softmax_scale=None, causal=False, **unexpected):
    assert not unexpected, unexpected
    assert page_table is not None and cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    batch = cu_seqlens_q.numel() - 1
    assert page_table.size(0) == batch and seqused_k.shape == (batch,)
    assert cu_seqlens_q.dtype == seqused_k.dtype == torch.int32
    assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype
    assert causal and softmax_scale is not None
    rows, lengths = cu_seqlens_q.tolist(), seqused_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(rows, rows[1:]))
    out = torch.zeros_like(q)
    for i, length in enumerate(lengths):
        pages = page_table[i, :-(-length // k.size(1))]
        keys, values = (cache[pages].flatten(0, 1)[:length].float() for cache in (k, v))
        out[rows[i]:rows[i + 1]] = naive_attention(q[rows[i]:rows[i + 1]].float(), keys, values, softmax_scale)
    return out, torch.zeros(q.size(1), q.size(0))


@pytest.fixture
def fake_flash_attn_4(monkeypatch):
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = fake_varlen
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)


@pytest.mark.parametrize("max_seqlen_q, q_lens, context_lens", [
    (6, [6, 5, 1], [6, 11, 10]),  # a prefill, a chunk over a cached prefix, a one-token chunk
    (1, [1, 1, 1], [14, 9, 3]),   # decode
])
def test_flash4_attend_passes_the_context_as_paged_varlen(fake_flash_attn_4, max_seqlen_q, q_lens, context_lens):
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 12, 4, 2, 8).to(torch.bfloat16).unbind(0)
    block_tables = torch.tensor([[3, 1, 7, 9], [0, 5, 10, -1], [11, 2, 6, -1]], dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ctx = Context(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=torch.tensor([0] + context_lens).cumsum(0),
                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max(context_lens),
                  context_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=block_tables)
    q = torch.randn(sum(q_lens), 4, 8).to(torch.bfloat16)
    out = Flash4Backend.attend(q, k_cache, v_cache, ctx, 0.3)
    for i, length in enumerate(context_lens):
        rows = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
        keys, values = (c[block_tables[i]].flatten(0, 1)[:length].float() for c in (k_cache, v_cache))
        torch.testing.assert_close(out[rows].float(), naive_attention(q[rows].float(), keys, values, 0.3),
                                   atol=1e-2, rtol=1e-2)
