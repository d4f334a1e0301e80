"""Speculative sampling of a draft model's sampled drafts keeps the target distribution: tokens verified against
fixed distributions, and a model's first sampled tokens with and without a draft model, checked by chi-square
statistics against bounds that chance exceeds with probability about 1e-5 (seeded, so repeatable)."""
import math
import random

import pytest
import torch
from test_spec_verifier import P, chi_square, chi_square_bound, peaked_model, two_sample_chi_square  # noqa: F401

from nanovllm import LLM, SamplingParams
from nanovllm.core.sequence import Sequence
from nanovllm.execution.draft_model import DraftModel
from nanovllm.execution.sampler import Sampler
from nanovllm.execution.verifier import verify

Q = [torch.tensor(q) for q in ([0.1, 0.5, 0.1, 0.1, 0.1, 0.1], [0.3, 0.1, 0.1, 0.4, 0.05, 0.05])]


def test_sampled_drafts_keep_the_target_distribution():
    """Drafts drawn from q, verified against p: each emitted position has p's distribution; the first draft is
    accepted with probability sum(min(p, q))."""
    n = 30000
    torch.manual_seed(0)
    sampler = Sampler(len(P[0]), eos_token_ids=[], device="cpu")
    seqs = [Sequence(i, [0, 1, 2], 16, SamplingParams(temperature=1.0)) for i in range(n)]
    drafts = torch.stack([torch.multinomial(q, n, replacement=True) for q in Q], dim=1).tolist()
    logits = torch.stack([p.log() for p in P]).repeat(n, 1)
    q = torch.stack(Q)
    out = verify(sampler, logits, list(zip(seqs, drafts)), draft_probs={seq.seq_id: q for seq in seqs})
    tokens, accepted = iter(out.token_ids), out.num_accepted
    emitted = [[next(tokens) for _ in range(a + 1)] for a in accepted]
    for position in range(3):
        counts = torch.bincount(torch.tensor([e[position] for e in emitted if len(e) > position]), minlength=6)
        assert chi_square(counts.float(), P[position]) < chi_square_bound(5)
    assert all(e[:a] == d[:a] for e, a, d in zip(emitted, accepted, drafts))
    overlap = float(torch.minimum(P[0], Q[0]).sum())
    assert abs(sum(a > 0 for a in accepted) / n - overlap) < 5 * math.sqrt(overlap * (1 - overlap) / n)


def test_first_tokens_have_the_same_distribution_with_and_without_a_draft_model(peaked_model,  # noqa: F811
                                                                                 monkeypatch):
    """Thousands of unseeded requests (torch's generator seeded) with top-k, top-p and min-p: the tokens at
    positions 2 and 3, where a 4-bit copy of the model drafts and speculative sampling verifies, are distributed
    alike with and without it."""
    monkeypatch.setattr(DraftModel, "forward_ratio", lambda self, num_seqs: 0.0)  # always speculate
    n = 2000
    rng = random.Random(12)
    prompt = [rng.randrange(384) for _ in range(12)]
    params = SamplingParams(temperature=1.5, top_k=50, top_p=0.98, min_p=0.01, max_tokens=3, ignore_eos=True)
    settings = dict(kvcache_block_size=16, device="cpu", dtype="float32", max_num_batched_tokens=4096)
    samples = {}
    for spec in (None, {"model": peaked_model, "quantization": "int4", "num_speculative_tokens": 2}):
        with LLM(peaked_model, speculative_config=spec, **settings) as llm:
            torch.manual_seed(1 if spec is None else 2)
            samples[spec is None] = [o["token_ids"] for o in llm.generate([prompt] * n, params, use_tqdm=False)]
            if spec is not None:
                stats = llm.stats()
                assert n // 4 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    for position in (1, 2):
        statistic, df = two_sample_chi_square(*([t[position] for t in samples[side]] for side in (True, False)))
        assert df >= 5 and statistic < chi_square_bound(df)


def test_a_mixed_batch_keeps_each_rows_rule_order_and_logprobs():
    """Point-mass and sampled drafts in one batch: each sequence gets its own rule's tokens, in batch order, with
    the raw logprobs of the tokens it emitted."""
    torch.manual_seed(3)
    sampler = Sampler(len(P[0]), eos_token_ids=[], device="cpu")
    greedy = Sequence(0, [0, 1], 16, SamplingParams(temperature=0, logprobs=2))
    sampled = Sequence(1, [0, 1], 16, SamplingParams(temperature=1.0, logprobs=1))
    plain = Sequence(2, [0, 1], 16, SamplingParams(temperature=0))
    logits = torch.stack([p.log() for p in P])
    rows = [(greedy, [0, 1]), (sampled, [1, 3]), (plain, [0, 1])]
    out = verify(sampler, torch.cat([logits] * 3), rows, draft_probs={1: torch.stack(Q)})
    accepted = out.num_accepted
    assert accepted[0] == accepted[2] == 2 and out.token_ids[:3] == out.token_ids[-3:] == [0, 1, 0]
    mine = out.token_ids[3:3 + accepted[1] + 1]
    assert mine[:accepted[1]] == [1, 3][:accepted[1]]
    for position, (token, logprobs) in enumerate(zip(mine, out.logprobs[3:3 + len(mine)])):
        assert logprobs.logprob == pytest.approx(float(P[position][token].log()), abs=1e-6)
    assert out.logprobs[0].logprob == pytest.approx(float(P[0][0].log()), abs=1e-6)
    assert out.logprobs[-1] is None
