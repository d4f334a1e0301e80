"""Verification of proposed tokens keeps the target distribution: sampled tokens, with and without drafts, checked
by chi-square statistics against bounds that chance exceeds with probability about 1e-5 (seeded, so repeatable)."""
import math
import random

import pytest
import torch
from checkpoints import make_checkpoint

from nanovllm import LLM, SamplingParams
from nanovllm.core.sequence import Sequence
from nanovllm.execution.sampler import Sampler
from nanovllm.execution.verifier import verify

P = [torch.tensor(p) for p in ([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], [0.05, 0.3, 0.3, 0.2, 0.1, 0.05],
                               [0.2, 0.2, 0.2, 0.2, 0.1, 0.1])]
DRAFTS = [1, 3]  # p0 gives draft 1 probability 0.25, p1 gives draft 3 0.2


def chi_square_bound(df: int) -> float:
    """Mean plus 8 standard deviations of a chi-square with `df` degrees of freedom (exceeded with p ~ 1e-5)."""
    return df + 8 * math.sqrt(2 * df)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_point_mass_drafts_keep_the_target_distribution():
    n = 30000
    torch.manual_seed(0)
    sampler = Sampler(len(P[0]), eos_token_ids=[], device="cpu")
    seqs = [Sequence(i, [0, 1, 2], 16, SamplingParams(temperature=1.0)) for i in range(n)]
    logits = torch.stack([p.log() for p in P]).repeat(n, 1)
    out = verify(sampler, logits, [(seq, DRAFTS) for seq in seqs])
    tokens, accepted = iter(out.token_ids), out.num_accepted
    emitted = [[next(tokens) for _ in range(a + 1)] for a in accepted]
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=6).float()
    assert chi_square(first, P[0]) < chi_square_bound(5)
    second = torch.bincount(torch.tensor([e[1] for e in emitted if len(e) > 1]), minlength=6).float()
    assert chi_square(second, P[1]) < chi_square_bound(5)
    third = torch.bincount(torch.tensor([e[2] for e in emitted if len(e) > 2]), minlength=6).float()
    assert chi_square(third, P[2]) < chi_square_bound(5)
    assert all(e[:a] == DRAFTS[:a] for e, a in zip(emitted, accepted))
    assert abs(sum(a > 0 for a in accepted) / n - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n)


def two_sample_chi_square(a: list[int], b: list[int], min_count: int = 10) -> tuple[float, int]:
    """Homogeneity of two equal-size samples: sum of (a_c - b_c)^2 / (a_c + b_c) over cells, the cells with fewer
    than `min_count` draws in both together pooled into one; returns the statistic and its degrees of freedom."""
    cells: dict[int, list[int]] = {}
    for sample, column in ((a, 0), (b, 1)):
        for token in sample:
            cells.setdefault(token, [0, 0])[column] += 1
    pooled, counts = [0, 0], []
    for x, y in cells.values():
        if x + y < min_count:
            pooled = [pooled[0] + x, pooled[1] + y]
        else:
            counts.append((x, y))
    if sum(pooled):
        counts.append(tuple(pooled))
    return sum((x - y) ** 2 / (x + y) for x, y in counts), len(counts) - 1


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory) -> str:
    """Larger random weights: next-token distributions peaked enough that drafts are often accepted, yet spread."""
    return make_checkpoint(str(tmp_path_factory.mktemp("peaked")), seed=0, initializer_range=0.6)


def test_first_tokens_have_the_same_distribution_with_and_without_speculation(peaked_model):
    """Thousands of seeds of one prompt that holds the model's own continuation (so lookup proposes what it may
    sample; its seed one of those whose continuation repeats enough for that, about 1 in 5): the tokens at positions
    2 and 3, where drafts are verified, are distributed alike with and without n-gram speculation (different seeds
    on each side)."""
    n, temperature = 2000, 0.7
    rng = random.Random(12)
    passage = [rng.randrange(384) for _ in range(6)]
    settings = dict(kvcache_block_size=16, device="cpu", dtype="float32", max_num_batched_tokens=4096)
    samples = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                        "prompt_lookup_min": 1, "disable_by_batch_size": 10 ** 6}):
        seeds = range(n) if spec is None else range(n, 2 * n)
        params = [SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=seed) for seed in seeds]
        with LLM(peaked_model, speculative_config=spec, **settings) as llm:
            own = llm.generate([passage], SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True,
                                                         seed=12), use_tqdm=False)[0]["token_ids"]
            samples[spec is None] = [o["token_ids"] for o in llm.generate([passage + own] * n, params,
                                                                          use_tqdm=False)]
            if spec is not None:
                assert llm.stats()["num_accepted_tokens"] > n // 4
    for position in (1, 2):
        statistic, df = two_sample_chi_square(*([t[position] for t in samples[side]] for side in (True, False)))
        assert df >= 5 and statistic < chi_square_bound(df)
