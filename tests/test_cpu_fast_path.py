"""The CPU fast path (prepacked oneDNN weights, the decode attention gather) stays token-exact
against transformers' greedy output, across block boundaries, prefix-cache hits and preemption."""
import random

import pytest

from checkpoints import hf_greedy
from nanovllm import LLM, SamplingParams


def prompts(n: int, lo: int, hi: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(384) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(384) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(model: str, batch: list[list[int]], max_tokens: int, **settings) -> tuple[list[list[int]], dict]:
    with LLM(model, device="cpu", **settings) as llm:
        outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [o["token_ids"] for o in outputs], llm.stats()


def test_linear_weights_are_prepacked_on_cpu(tied_model):
    with LLM(tied_model, device="cpu") as llm:
        model = llm.model_runner.model
        assert model.lm_head.weight.is_mkldnn
        assert not model.model.embed_tokens.weight.is_mkldnn
        assert all(layer.mlp.down_proj.weight.is_mkldnn for layer in model.model.layers)


@pytest.mark.parametrize("block_size", [256, 16])
def test_greedy_matches_transformers(tied_model, untied_model, block_size):
    batch = prompts(5, 3, 40, seed=block_size)
    for model in (tied_model, untied_model):
        ours, _ = greedy(model, batch, 24, kvcache_block_size=block_size)
        assert ours == hf_greedy(model, batch, 24)


def test_greedy_matches_transformers_with_prefix_cache_hits(tied_model):
    batch = prompts(4, 2, 10, seed=7, shared_prefix=40)
    ours, stats = greedy(tied_model, batch, 12, kvcache_block_size=16)
    assert stats["num_cached_tokens"] >= 3 * 32
    assert ours == hf_greedy(tied_model, batch, 12)


def test_greedy_matches_transformers_under_preemption(untied_model):
    batch = prompts(4, 12, 20, seed=3)
    ours, stats = greedy(untied_model, batch, 24, kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=6)
    assert stats["num_preemptions"] > 0
    assert ours == hf_greedy(untied_model, batch, 24)

