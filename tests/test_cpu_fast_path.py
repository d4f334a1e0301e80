"""The CPU fast path (prepacked oneDNN weights, copy-free decode attention) stays token-exact
against transformers' greedy output, across block boundaries, prefix-cache hits and preemption."""
import random

import pytest
import torch

from checkpoints import hf_greedy
from nanovllm import LLM, SamplingParams
from nanovllm.backends.torch_backend import TorchBackend, _attend
from nanovllm.utils.context import Context


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



def test_cpu_decode_reads_scattered_blocks_in_place():
    """Blocks out of order and split into runs give the same attention as gathering them first."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 10, 4, 2, 8).unbind(0)
    block_tables = torch.tensor([[7, 2, 3, 9], [0, 1, 2, -1], [5, -1, -1, -1]])
    context_lens = torch.tensor([14, 9, 3])
    q = torch.randn(3, 4, 8)
    ctx = Context(block_tables=block_tables, context_lens=context_lens)
    out = TorchBackend.decode(q, k_cache, v_cache, ctx, 0.3)
    for i in range(3):
        length = int(context_lens[i])
        k = k_cache[block_tables[i]].flatten(0, 1)[:length]
        v = v_cache[block_tables[i]].flatten(0, 1)[:length]
        torch.testing.assert_close(out[i:i + 1], _attend(q[i:i + 1], k, v, 0.3))
