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
