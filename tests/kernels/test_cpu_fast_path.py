"""The CPU fast path: prepacked oneDNN weights, and the torch backend's one varlen attention contract.

Its token-exactness against transformers is covered by test_engine_parity.py, which runs on this path."""
import pytest
import torch

from nanovllm import LLM
from nanovllm.kernels.attention.context import Context
from nanovllm.kernels.attention.torch_backend import TorchBackend
from nanovllm.layers.prepack import native_bfloat16


def test_linear_weights_are_prepacked_on_cpu(tied_model):
    with LLM(tied_model, device="cpu", dtype="float32") as llm:
        model = llm.engine.model_runner.model
        assert model.lm_head.weight.is_mkldnn
        assert not model.model.embed_tokens.weight.is_mkldnn
        assert all(layer.mlp.down_proj.weight.is_mkldnn for layer in model.model.layers)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """Softmax attention written out: q `[Lq, H, D]` over k/v `[Lk, Hkv, D]`, queries the last Lq positions, each
    seeing the last `window` positions up to itself, scores capped by softcap * tanh(score / softcap)."""
    lq, lk, group = q.size(0), k.size(0), q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    keys, queries = torch.arange(lk)[None, :], torch.arange(lk - lq, lk)[:, None]
    allowed = (keys <= queries) & ((keys > queries - window) if window else True)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def test_cpu_decode_reads_scattered_blocks_in_place():
    """Blocks out of order and split into runs give the same attention as gathering them first."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 10, 4, 2, 8).unbind(0)
    block_tables = torch.tensor([[7, 2, 3, 9], [0, 1, 2, -1], [5, -1, -1, -1]])
    context_lens = torch.tensor([14, 9, 3])
    q = torch.randn(3, 4, 8)
    ctx = Context(cu_seqlens_q=torch.arange(4), max_seqlen_q=1, context_lens=context_lens, block_tables=block_tables)
    out = TorchBackend.attend(q, k_cache, v_cache, ctx, 0.3)
    for i in range(3):
        length = int(context_lens[i])
        k = k_cache[block_tables[i]].flatten(0, 1)[:length]
        v = v_cache[block_tables[i]].flatten(0, 1)[:length]
        torch.testing.assert_close(out[i:i + 1], naive_attention(q[i:i + 1], k, v, 0.3))


def test_mixed_batch_of_prefill_chunk_decode_and_padding():
    """One varlen batch: a whole prefill, a chunk over a cached prefix, a decode and a padding row."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 12, 4, 2, 8).unbind(0)
    block_tables = torch.tensor([[3, 1, -1], [0, 5, 9], [11, 2, 7], [-1, -1, -1]])
    q_lens, context_lens = [6, 5, 1, 1], torch.tensor([6, 11, 10, 0])
    cu_seqlens_q = torch.tensor([0, 6, 11, 12, 13])
    q = torch.randn(13, 4, 8)
    ctx = Context(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=6, context_lens=context_lens, block_tables=block_tables)
    out = TorchBackend.attend(q, k_cache, v_cache, ctx, 0.3)
    for i in range(3):
        length, rows = int(context_lens[i]), slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
        k = k_cache[block_tables[i]].flatten(0, 1)[:length]
        v = v_cache[block_tables[i]].flatten(0, 1)[:length]
        torch.testing.assert_close(out[rows], naive_attention(q[rows], k, v, 0.3))
    assert q_lens == (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    assert torch.equal(out[12], torch.zeros(4, 8))


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (6, 6, 32), (16, 8, 128)])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_every_kind_of_row_against_a_float64_reference(block_size, heads, kv_heads, head_dim, dtype, atol):
    """The CPU attention of one step (a whole prompt, a chunk over a cached prefix, a one-token chunk, decodes, a
    padding row) with its blocks scattered over the cache, against float64 attention written out."""
    check_every_kind_of_row(block_size, heads, kv_heads, head_dim, dtype, atol)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("window, softcap", [(24, 0.0), (0, 2.0), (100, 2.0)])
def test_every_kind_of_row_with_a_window_or_capped_scores(block_size, window, softcap):
    """The same with a sliding window (the blocks wholly before it released, -1 in the table) and capped scores."""
    check_every_kind_of_row(block_size, 8, 2, 64, torch.float32, 2e-5, window, softcap)


def check_every_kind_of_row(block_size: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                            atol: float, window: int = 0, softcap: float = 0.0) -> None:
    generator = torch.Generator().manual_seed(block_size + heads)
    q_lens, context_lens = [40, 30, 1, 1, 1, 1], [40, 300, 17, 1, 520, 0]
    widths = [-(-n // block_size) for n in context_lens]
    order = torch.randperm(sum(widths) + 2, generator=generator).tolist()
    tables, used = [], 0
    for n in widths:
        tables.append(order[used:used + n] + [-1] * (max(widths) - n))
        used += n
    shape = (len(order), block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    q = torch.randn(sum(q_lens), heads, head_dim, generator=generator).to(dtype)
    cu_seqlens_q = torch.tensor([0, *q_lens]).cumsum(0)
    block_tables = torch.tensor(tables)
    released = block_tables.clone()
    for i, (n, length) in enumerate(zip(q_lens, context_lens)):
        released[i, :max(0, length - n - window + 1) // block_size if window else 0] = -1
    ctx = Context(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max(q_lens), context_lens=torch.tensor(context_lens),
                  block_tables=released)
    out = TorchBackend.attend(q, k_cache, v_cache, ctx, head_dim ** -0.5, window=window, softcap=softcap)
    assert out.dtype == dtype
    for i, length in enumerate(context_lens):
        rows = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
        if not length:
            assert not out[rows].any(), "a padding row attends to nothing"
            continue
        k = k_cache[block_tables[i, :widths[i]]].flatten(0, 1)[:length].double()
        v = v_cache[block_tables[i, :widths[i]]].flatten(0, 1)[:length].double()
        expected = naive_attention(q[rows].double(), k, v, head_dim ** -0.5, window, softcap)
        torch.testing.assert_close(out[rows].double(), expected, atol=atol, rtol=0)


def test_bfloat16_weights_are_prepacked_where_the_cpu_runs_bfloat16_natively(tied_model, monkeypatch):
    from nanovllm import SamplingParams
    from nanovllm.execution import model_loading

    prompts = [[1, 2, 3, 4, 5], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(tied_model, device="cpu", dtype="bfloat16") as llm:
        native = native_bfloat16()
        layers = llm.engine.model_runner.model.model.layers
        assert all(layer.mlp.down_proj.weight.is_mkldnn == native for layer in layers)
        packed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(model_loading, "can_prepack", lambda dtype: False)
    with LLM(tied_model, device="cpu", dtype="bfloat16") as llm:
        assert not llm.engine.model_runner.model.model.layers[0].mlp.down_proj.weight.is_mkldnn
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == packed


def test_auto_dtype_on_cpu_is_bfloat16_only_where_the_cpu_computes_it_natively(tied_model, monkeypatch):
    from transformers import AutoConfig

    from nanovllm.engine import setup as config

    with LLM(tied_model, device="cpu") as llm:
        assert llm.engine.model_runner.config.torch_dtype == (torch.bfloat16 if native_bfloat16() else torch.float32)
    hf_config = AutoConfig.from_pretrained(tied_model)  # a float32 checkpoint
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(config, "native_bfloat16", lambda native=native: native)
        assert config.resolve_dtype("auto", "cpu", hf_config) == expected
        assert config.resolve_dtype("float32", "cpu", hf_config) == torch.float32
    assert config.resolve_dtype("auto", "cuda", hf_config) == torch.bfloat16


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_the_cpu_kv_cache_takes_memory_only_where_it_is_written(tied_model):
    from nanovllm import SamplingParams

    before = _rss_bytes()
    with LLM(tied_model, device="cpu", dtype="float32", cpu_kvcache_gib=2, max_num_seqs=4096) as llm:
        cache = llm.engine.model_runner.kv_cache.tensor
        assert cache.numel() * cache.element_size() > 1.9 * 2**30
        assert _rss_bytes() - before < 0.5 * 2**30, "reserved, not committed"
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[1, 2, 3]] * 8, params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        assert cache.flatten()[-1000:].eq(0).all(), "blocks never written read as zeros"
        assert _rss_bytes() - before < 0.5 * 2**30
