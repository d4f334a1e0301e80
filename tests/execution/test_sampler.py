"""The batched sampler against independent references on the same logits: transformers' logits processors and
warpers, log_softmax, hand-written penalties, and a chi-square test of the drawn tokens."""
import shutil
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanovllm import SamplingParams
from nanovllm.execution.sampler import Sampler, SamplingRow
from nanovllm.execution.sampling_ops import (
    apply_penalties,
    apply_top_k,
    apply_top_p,
    apply_top_p_sorting_few,
    inverse_cdf,
)
from nanovllm.kernels import fused
from nanovllm.kernels.cpu import cpu_kernels

EOS = 5
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="the CPU kernels need a C++ compiler")


@pytest.fixture(params=["torch", pytest.param("kernel", marks=needs_compiler)])
def draws(request, monkeypatch) -> str:
    """Sampled rows drawn by the torch ops, or on the CPU by the compiled kernel (`kernels/csrc/sampling.cpp`)."""
    monkeypatch.setattr(fused, "_cpu_kernels", cpu_kernels() if request.param == "kernel" else None)
    return request.param


def rows_for(params: list[SamplingParams], prompts: list[list[int]] | None = None, first_id: int = 0):
    prompts = prompts or [[1, 2, 3]] * len(params)
    return [SamplingRow(first_id + i, p, list(prompt), len(prompt))
            for i, (p, prompt) in enumerate(zip(params, prompts))]


def run_steps(sampler: Sampler, rows: list[SamplingRow], logits: list[torch.Tensor]) -> list[list[int]]:
    """Sample each step's logits and append the tokens to the rows, as the engine does; each row's tokens."""
    for step_logits in logits:
        for row, token in zip(rows, sampler(step_logits.to(sampler.device), rows).token_ids):
            row.token_ids.append(token)
    return [row.token_ids[row.num_prompt_tokens:] for row in rows]


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-9), SamplingParams(min_p=1.0),
                                    SamplingParams(temperature=1.5, min_p=0.999999), SamplingParams(temperature=0)])
def test_degenerate_truncation_is_greedy(params, draws):
    torch.manual_seed(0)
    logits = torch.randn(64, 1000) * 3
    out = Sampler(1000, {EOS}, "cpu")(logits, rows_for([params] * 64))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(8, 500)
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.0, top_k=5, top_p=0.8)
              for i in range(8)]
    out = Sampler(500, {EOS}, "cpu")(logits, rows_for(params))
    greedy = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 8, 2)] == [greedy[i] for i in range(1, 8, 2)]
    assert [out.token_ids[i] for i in range(0, 8, 2)] != [greedy[i] for i in range(0, 8, 2)]


def seeded_tokens(seed: int, position: int, batch: int, seq_id: int, others_seed: int, device: str) -> list[int]:
    """Five steps of one seeded request at row `position` of a batch of `batch`, the other rows a mix of
    unseeded, seeded, greedy and penalized requests; the first draws from torch's default generator."""
    torch.manual_seed(others_seed)
    steps = [torch.randn(batch, 1000) * 0.1 for _ in range(5)]
    target = torch.Generator().manual_seed(99)
    for step in steps:
        step[position] = torch.randn(1000, generator=target) * 0.1
    kinds = [SamplingParams(), SamplingParams(seed=7, top_k=20), SamplingParams(temperature=0),
             SamplingParams(top_p=0.5, repetition_penalty=1.2, logprobs=2)]
    params = [kinds[i % len(kinds)] for i in range(batch)]
    params[position] = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    rows = rows_for(params, first_id=seq_id - position)
    return run_steps(Sampler(1000, {EOS}, device), rows, steps)[position]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_is_independent_of_its_batch(device):
    alone = seeded_tokens(42, position=0, batch=1, seq_id=0, others_seed=0, device=device)
    assert seeded_tokens(42, position=0, batch=1, seq_id=0, others_seed=1, device=device) == alone  # another run
    assert seeded_tokens(42, position=3, batch=7, seq_id=11, others_seed=2, device=device) == alone
    assert seeded_tokens(42, position=1, batch=4, seq_id=5, others_seed=3, device=device) == alone
    assert seeded_tokens(43, position=0, batch=1, seq_id=0, others_seed=0, device=device) != alone  # the seed matters


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(expected) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


LOGITS_8 = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.4, 0.0, -0.5, -1.0])


@pytest.mark.parametrize("params, warpers", [
    (SamplingParams(temperature=0.8), [TemperatureLogitsWarper(0.8)]),
    (SamplingParams(temperature=1.3, top_k=3), [TemperatureLogitsWarper(1.3), TopKLogitsWarper(3)]),
    (SamplingParams(temperature=1.0, top_p=0.7), [TopPLogitsWarper(0.7)]),
    (SamplingParams(temperature=0.7, min_p=0.15), [TemperatureLogitsWarper(0.7), MinPLogitsWarper(0.15)]),
    # vLLM's order: temperature, min-p, top-k, top-p
    (SamplingParams(temperature=1.5, min_p=0.1, top_k=6, top_p=0.8),
     [TemperatureLogitsWarper(1.5), MinPLogitsWarper(0.1), TopKLogitsWarper(6), TopPLogitsWarper(0.8)]),
])
def test_draws_follow_the_truncated_distribution(params, warpers, draws):
    num_draws = 6000
    scores = LOGITS_8.unsqueeze(0)
    for warper in warpers:
        scores = warper(None, scores)
    target = scores.softmax(dim=-1)[0].double()
    kept = target > 0
    assert bool(kept.all()) == (params.top_k == -1 and params.top_p == 1 and params.min_p == 0)
    expected = target[kept] * num_draws
    assert expected.min() >= 5  # chi-square's approximation holds
    torch.manual_seed(1234)
    drawn = Sampler(8, {EOS}, "cpu")(LOGITS_8.expand(num_draws, 8), rows_for([params] * num_draws)).token_ids
    counts = torch.bincount(torch.tensor(drawn), minlength=8).double()
    assert counts[~kept].sum() == 0  # truncated tokens are never drawn
    assert chi_square_p_value(counts[kept], expected) > 1e-4


def test_chi_square_rejects_a_wrong_distribution():
    """The goodness-of-fit check above has teeth: draws at temperature 1 fail against the temperature 0.85 target."""
    torch.manual_seed(1234)
    drawn = Sampler(8, {EOS}, "cpu")(LOGITS_8.expand(6000, 8), rows_for([SamplingParams()] * 6000)).token_ids
    counts = torch.bincount(torch.tensor(drawn), minlength=8).double()
    target = (LOGITS_8 / 0.85).softmax(dim=-1).double()
    assert chi_square_p_value(counts, target * 6000) < 1e-4


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int],
                        params: SamplingParams) -> torch.Tensor:
    """transformers' repetition penalty over prompt + output, then frequency and presence on output tokens."""
    ids = torch.tensor([prompt + output])
    scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, logits.unsqueeze(0))[0]
    for token, count in Counter(output).items():
        scores[token] -= params.frequency_penalty * count + params.presence_penalty
    return scores


PENALIZED = [SamplingParams(temperature=0, repetition_penalty=1.3),
             SamplingParams(temperature=0, repetition_penalty=0.7, presence_penalty=0.5),
             SamplingParams(temperature=0, frequency_penalty=0.4),
             SamplingParams(temperature=0, repetition_penalty=1.1, presence_penalty=-0.3, frequency_penalty=1.5)]


def test_repetition_penalty_equals_transformers():
    torch.manual_seed(2)
    logits = torch.randn(3, 40) * 4
    seen = [[1, 5, 9, 5], [0, 39], list(range(0, 40, 3))]
    prompt_mask = torch.zeros(3, 40, dtype=torch.bool)
    for row, ids in enumerate(seen):
        prompt_mask[row, ids] = True
    penalty = torch.tensor([1.3, 0.6, 2.0])
    ours = apply_penalties(logits, prompt_mask, torch.zeros(3, 40, dtype=torch.int32), penalty, torch.zeros(3),
                           torch.zeros(3))
    for row, ids in enumerate(seen):
        expected = RepetitionPenaltyLogitsProcessor(float(penalty[row]))(torch.tensor([ids]), logits[row:row + 1])
        assert torch.equal(ours[row], expected[0])
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_over_steps_equal_recomputing_them(device):
    """Greedy rows with penalties, a plain row and a sampled penalized row, eight steps: every greedy token is the
    argmax of the reference-penalized logits, and the device state then gives the reference's penalized logits and
    holds exactly a recount of the tokens."""
    torch.manual_seed(3)
    vocab = 30
    params = PENALIZED + [SamplingParams(temperature=0), SamplingParams(temperature=1.0, frequency_penalty=2.0)]
    prompts = [[1, 2, 3, 2], [4], [7, 7, 8], [0, 29, 29], [5, 6], [9, 10]]
    rows = rows_for(params, prompts, first_id=100)
    sampler = Sampler(vocab, {EOS}, device)
    for _ in range(8):
        logits = torch.randn(len(rows), vocab)
        out = sampler(logits.to(device), rows)
        for i, row in enumerate(rows[:len(PENALIZED)]):
            expected = reference_penalties(logits[i], row.token_ids[:row.num_prompt_tokens],
                                           row.token_ids[row.num_prompt_tokens:], row.params)
            assert out.token_ids[i] == int(expected.argmax())
        for row, token in zip(rows, out.token_ids):
            row.token_ids.append(token)
    assert all(len(set(row.token_ids[row.num_prompt_tokens:])) > 1 for row in rows[:len(PENALIZED)])
    logits = torch.randn(vocab)
    assert sampler.entries.keys() == {row.seq_id for row in rows if row.params.uses_penalties}
    for row in rows:
        if not row.params.uses_penalties:
            continue
        slot, p = sampler.entries[row.seq_id], row.params
        prompt, output = row.token_ids[:row.num_prompt_tokens], row.token_ids[row.num_prompt_tokens:]
        prompt_mask = sampler.prompt_mask[slot:slot + 1].cpu()
        output_counts = sampler.output_counts[slot:slot + 1].cpu()
        assert torch.equal(output_counts[0], torch.bincount(torch.tensor(output), minlength=vocab).int())
        assert prompt_mask[0].nonzero().flatten().tolist() == sorted(set(prompt))
        ours = apply_penalties(logits.unsqueeze(0), prompt_mask, output_counts, torch.tensor([p.repetition_penalty]),
                               torch.tensor([p.presence_penalty]), torch.tensor([p.frequency_penalty]))[0]
        torch.testing.assert_close(ours, reference_penalties(logits, prompt, output, p))


def test_state_is_rebuilt_when_a_sample_was_dropped_and_released():
    sampler = Sampler(20, {EOS}, "cpu")
    row = SamplingRow(7, SamplingParams(temperature=0, frequency_penalty=1.0), [1, 2, 3], 3)
    sampler(torch.randn(1, 20), [row])  # the engine drops this sample (say, a partial prefill)
    row.token_ids += [4, 4]  # and the sequence goes on with other tokens
    sampler(torch.randn(1, 20), [row])
    assert sampler.output_counts[sampler.entries[7]][4] == 2 and sampler.output_counts[sampler.entries[7]].sum() == 3
    sampler.release([7])
    assert sampler.entries == {} and sampler.counted == {} and sampler.free_entries == [0]
    other = SamplingRow(8, SamplingParams(repetition_penalty=1.5, seed=3), [9], 1)
    sampler(torch.randn(1, 20), [other])
    assert sampler.entries == {8: 0} and sampler.output_counts[0].sum() == 1 and sampler.prompt_mask[0].sum() == 1
    assert set(sampler.generators) == {8}
    sampler.release([8, 99])
    assert sampler.generators == {}


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.zeros(4, 12)
    logits[:, EOS] = 100
    logits[:, 9] = 90
    logits[:, 3] = 80
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9]),
              SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[9]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9], ignore_eos=True),
              SamplingParams(temperature=0)]
    rows = rows_for(params)
    sampler = Sampler(12, {EOS}, "cpu")
    steps = [sampler(logits, rows).token_ids for _ in range(2)]
    for row in rows:
        row.token_ids += [3, 3]
    steps.append(sampler(logits, rows).token_ids)
    assert steps[0] == steps[1] == [3, 3, EOS, EOS]  # fewer than 2 completion tokens: EOS and 9 are out
    assert steps[2] == [EOS, EOS, EOS, EOS]


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(4)
    logits = torch.randn(5, 50) * 2
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.5),
              SamplingParams(temperature=1.0, logprobs=0, repetition_penalty=1.5),
              SamplingParams(temperature=2.0, top_k=10, logprobs=5), SamplingParams(temperature=0, logprobs=1)]
    out = Sampler(50, {EOS}, "cpu")(logits, rows_for(params))
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        got, token = out.logprobs[i], out.token_ids[i]
        assert got.logprob == pytest.approx(float(reference[i, token]), abs=1e-6)
        assert got.rank == 1 + int((reference[i] > reference[i, token]).sum())
        top = reference[i].topk(p.logprobs)
        assert got.top_ids == top.indices.tolist()
        assert got.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out.logprobs[0].rank == out.logprobs[4].rank == 1
    assert out.logprobs[3].rank > 1 or out.logprobs[2].rank > 1  # sampled rows are not all the top token


def test_no_logprobs_when_none_asked():
    out = Sampler(10, {EOS}, "cpu")(torch.randn(2, 10), rows_for([SamplingParams()] * 2))
    assert out.logprobs is None and len(out.token_ids) == 2


def test_top_p_sorting_only_the_likely_tokens_equals_the_full_sort():
    """Rows from flat to peaked: nuclei within 256 candidates, within 4,096, beyond (sorted whole), and top_p 1."""
    torch.manual_seed(4)
    scales = torch.tensor([0.02, 0.3, 1.0, 3.0, 8.0]).repeat(5)
    logits = torch.randn(len(scales), 6000) * scales.unsqueeze(1)
    top_p = torch.rand(len(scales)) * 0.98 + 0.01
    top_p[:3] = torch.tensor([1.0, 0.999, 0.5])
    ours = apply_top_p_sorting_few(logits, top_p)
    assert torch.equal(ours, apply_top_p(logits, top_p))
    nuclei = (ours > float("-inf")).sum(dim=-1)
    assert (nuclei <= 256).any() and ((nuclei > 256) & (nuclei <= 4096)).any() and (nuclei[1:] > 4096).any()
    assert nuclei[0] == 6000


@needs_compiler
def test_the_cpu_kernel_draws_the_torch_ops_tokens():
    """At the same uniform draws, the kernel's tokens are the torch ops' (`_truncated`, then the inverse CDF), from
    flat to peaked rows, with masked tokens, min-p, top-k (ties at the k-th kept), top-p, and all of them."""
    kernel = cpu_kernels().sample_tokens
    torch.manual_seed(5)
    vocab, rows = 5000, 16
    sampler = Sampler(vocab, {EOS}, "cpu")
    for trial in range(40):
        logits = torch.randn(rows, vocab) * [0.5, 2.0, 5.0, 10.0][trial % 4]
        if trial % 5 == 0:
            logits[:, ::3] = float("-inf")  # a grammar's mask
        if trial % 7 == 0:
            logits = logits.round()  # ties
        params = [SamplingParams(temperature=0.3 + 0.9 * (r % 3) / 2, min_p=[0.0, 0.05, 0.2][r % 3],
                                 top_k=[-1, 1, 5, 50, 1000][(r + trial) % 5], top_p=[1.0, 0.9, 0.5, 0.99][r // 4])
                  for r in range(rows)]
        uniform = torch.rand(rows, dtype=torch.float64)
        expected = inverse_cdf(sampler._truncated(logits, params, [False] * rows).softmax(dim=-1), uniform)
        got = kernel(logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.min_p for p in params]),
                     torch.tensor([max(p.top_k, 0) for p in params]), torch.tensor([p.top_p for p in params]),
                     uniform)
        if trial % 7:
            assert torch.equal(got, expected), trial
        else:  # which of the tokens tied at a boundary are kept is the sort's choice: one at least as likely
            kept = sampler._truncated(logits, params, [False] * rows) > float("-inf")
            assert all(logits[r, got[r]] >= logits[r][kept[r]].min() for r in range(rows)), trial


def test_top_p_over_the_top_k_candidates_equals_the_full_sort():
    torch.manual_seed(3)
    logits = torch.randn(16, 2000) * 2
    top_k = torch.randint(1, 40, (16,))
    truncated = apply_top_k(logits, top_k, 40)
    top_p = torch.rand(16) * 0.9 + 0.05
    assert torch.equal(apply_top_p(truncated, top_p, candidates=40), apply_top_p(truncated, top_p))
