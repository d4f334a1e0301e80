"""GPU KV-cache sizing: the budget arithmetic and the warm-up pass, exercised on CPU."""
import pytest
import torch

from nanovllm import LLM
from nanovllm.execution.kv_cache import (
    WARMUP_SAMPLING,
    bind_kv_cache,
    kv_cache_budget,
    kv_cache_shape,
    warmup,
    warmup_batch_size,
    warmup_cache_blocks,
)
from nanovllm.kernels.attention.context import Context, get_context

GiB = 2**30


def test_budget_subtracts_usage_and_the_warmup_transient():
    # 80 GiB device at 90%: 72 GiB; 10 GiB in use (weights, other processes); warm-up peaked 6 GiB above
    # what is still allocated, and later steps need that again.
    assert kv_cache_budget(80 * GiB, 70 * GiB, peak=9 * GiB, current=3 * GiB, utilization=0.9) == 56 * GiB


def test_budget_is_never_negative():
    assert kv_cache_budget(16 * GiB, 1 * GiB, peak=8 * GiB, current=2 * GiB, utilization=0.5) == 0


@pytest.mark.parametrize("batched, max_len, max_seqs, expected", [(16384, 4096, 512, 4), (8192, 1024, 3, 3),
                                                                    (4096, 4096, 512, 1), (16384, 40960, 512, 1)])
def test_warmup_batch_is_the_largest_prefill_the_budget_allows(batched, max_len, max_seqs, expected):
    class Settings:
        max_num_batched_tokens, max_model_len, max_num_seqs = batched, max_len, max_seqs

    assert warmup_batch_size(Settings) == expected


def test_warmup_runs_over_one_shared_layer_of_cache(tied_model):
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=64,
             max_num_batched_tokens=160, max_num_seqs=5) as llm:
        runner = llm.engine.model_runner
        config = runner.config
        blocks = warmup_cache_blocks(config)
        assert blocks == 2 * 4  # two max-length sequences of four 16-token blocks
        shape = list(kv_cache_shape(config, blocks))
        num_layers, shape[1] = shape[1], 1
        scratch = torch.zeros(shape)
        runner.exit()
        bind_kv_cache(runner.model, scratch.expand(-1, num_layers, *shape[2:]))
        sampler = runner.sampler
        warmup(runner.model, sampler, config, torch.device("cpu"))
        # one sample over a full decode batch of 5, penalized (so counted) on every row; then the rows were released
        assert sampler.output_counts.shape == (5, config.hf_config.vocab_size) and int(sampler.output_counts.sum()) == 5
        assert sampler.entries == {} and sampler.generators == {} and sorted(sampler.free_entries) == list(range(5))
        assert get_context() == Context()
        assert scratch.abs().sum(dim=(1, 3, 4, 5)).gt(0).all()  # every block of both sequences was written


def test_warmup_samples_with_every_feature():
    p = WARMUP_SAMPLING
    assert p.temperature > 0 and p.top_p < 1 and p.top_k > 0 and p.min_p > 0 and p.seed is not None
    assert p.min_tokens > 0 and p.stop_token_ids and p.logprobs and p.repetition_penalty != 1
    assert p.presence_penalty and p.frequency_penalty


def test_warmup_attends_a_full_decode_batch_at_max_model_len(tied_model, monkeypatch):
    """After the prefill, the warm-up runs a decode of max_num_seqs sequences, each over max_model_len tokens (what
    the longest contexts need of the attention kernels; the torch backend gathers them), writing nothing."""
    from nanovllm.layers import attention

    seen = []

    def recording() -> Context:
        ctx = get_context()
        seen.append((ctx.max_seqlen_q, ctx.context_lens.tolist(), ctx.block_tables.size(1), ctx.slot_mapping.tolist()))
        return ctx

    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=64,
             max_num_batched_tokens=160, max_num_seqs=5) as llm:
        runner = llm.engine.model_runner
        config = runner.config
        shape = list(kv_cache_shape(config, warmup_cache_blocks(config)))
        num_layers, shape[1] = shape[1], 1
        runner.exit()
        bind_kv_cache(runner.model, torch.zeros(shape).expand(-1, num_layers, *shape[2:]))
        monkeypatch.setattr(attention, "get_context", recording)
        warmup(runner.model, runner.sampler, config, torch.device("cpu"))
    decodes = [s for s in seen if s[0] == 1]
    assert decodes and all(s == (1, [64] * 5, 4, [-1] * 5) for s in decodes)
    assert len(decodes) == config.hf_config.num_hidden_layers


def test_batched_decode_in_bounded_groups_equals_one_gather(monkeypatch):
    """The torch backend's batched decode (its CUDA path; plain torch, so run here) takes rows in groups whose
    gathered K/V stay under DECODE_GATHER_BYTES: each row is what one gather of the whole batch gives (to rounding
    here: on CUDA the memory-efficient kernel it runs computes each row alone, bit for bit whatever its batch)."""
    from nanovllm.kernels.attention import torch_backend

    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(24, 16, 2, 32, generator=g) for _ in range(2))
    q = torch.randn(9, 4, 32, generator=g)
    ctx = Context(context_lens=torch.tensor([1, 5, 16, 17, 40, 64, 3, 33, 50], dtype=torch.int32),
                  block_tables=torch.randint(0, 24, (9, 4), generator=g, dtype=torch.int32), max_seqlen_q=1)
    whole = torch_backend._decode_batched(q, k_cache, v_cache, ctx, 0.2, window=24, softcap=0.0)
    row_bytes = 2 * 4 * 16 * 2 * 32 * 4
    monkeypatch.setattr(torch_backend, "DECODE_GATHER_BYTES", 2 * row_bytes)
    groups, decode_rows = [], torch_backend._decode_rows
    monkeypatch.setattr(torch_backend, "_decode_rows",
                        lambda q, *rest: groups.append(q.size(0)) or decode_rows(q, *rest))
    grouped = torch_backend._decode_batched(q, k_cache, v_cache, ctx, 0.2, window=24, softcap=0.0)
    assert groups == [2, 2, 2, 2, 1]
    torch.testing.assert_close(grouped, whole, rtol=1e-6, atol=1e-6)
