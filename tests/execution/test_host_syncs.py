"""Host syncs per step. On CUDA every host read of a device tensor (`.tolist()`, `.item()`, `bool(t)`, `.cpu()`...)
and every blocking copy of a host list to the device (`torch.tensor(data, device=...)`, indexing with a Python list)
waits for the GPU: a pipeline bubble each. Counted on the CPU, in one engine step, for the reads that the sampler,
the verifier and the draft model make (the innermost frame of the package that makes them is one of theirs; the
engine's bookkeeping, the model and the attention backends are not counted): a step's results reach the host in one
transfer (`sampler.to_host`, which waits once however many tensors it copies), and nothing else is read."""
import random
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import make_checkpoint
from torch.overrides import TorchFunctionMode

import nanovllm
from nanovllm import LLM, SamplingParams
from nanovllm.execution import draft_model, sampler
from nanovllm.execution.draft_model import DraftModel
from nanovllm.execution.sampler import Sampler, SamplingRow

PACKAGE = Path(nanovllm.__file__).parent
COUNTED = {str(PACKAGE / "execution" / f"{name}.py") for name in ("sampler", "sampling_ops", "verifier", "draft_model")}
READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.__complex__, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
         torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique, torch.unique}
SETTINGS = dict(kvcache_block_size=16, max_model_len=512, device="cpu", dtype="float32")


def host_read(func, args: tuple, kwargs: dict) -> str | None:
    """What waits for the device in this call, if anything: a read of its values, a tensor whose size depends on
    them, or a blocking copy from the host."""
    if func in READS:
        return func.__name__
    if func in (torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.cuda) and not kwargs.get("non_blocking"):
        if func is not torch.Tensor.to or any(isinstance(a, (str, torch.device)) for a in args[1:]) \
                or "device" in kwargs:
            return f"blocking {func.__name__}"
    if func is torch.tensor and kwargs.get("device") is not None:
        return "torch.tensor(device=...)"
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put,
                torch.Tensor.index_put_):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, list) or isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            return "indexing with a host list or a mask"
    return None


def caller() -> str | None:
    """The innermost frame of the package on the stack: the code that made the call."""
    frame = sys._getframe(2)
    while frame is not None and not frame.f_code.co_filename.startswith(str(PACKAGE)):
        frame = frame.f_back
    return None if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class HostSyncs(TorchFunctionMode):
    """Counts the host syncs of the sampler, the verifier and the draft model: each `to_host` transfer once (the
    reads inside it are its own), and every other read of theirs."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.transferring = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = None if self.transferring else host_read(func, args, kwargs)
        if what is not None:
            where = caller()
            if where is not None and where.split(":")[0] in COUNTED:
                self.syncs.append(f"{what} at {where}")
        return func(*args, **kwargs)

    def counting(self, to_host):
        def transfer(tensors):
            self.syncs.append(f"one transfer of {len(tensors)} tensors")
            self.transferring += 1
            try:
                return to_host(tensors)
            finally:
                self.transferring -= 1

        return transfer


@pytest.fixture
def syncs(monkeypatch) -> HostSyncs:
    mode = HostSyncs()
    monkeypatch.setattr(Sampler, "reads_cost_nothing", False)  # the paths a CUDA device takes
    for module in (sampler, draft_model):
        if hasattr(module, "to_host"):
            monkeypatch.setattr(module, "to_host", mode.counting(module.to_host))
    return mode


def run_steps(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
              syncs: HostSyncs) -> list[tuple[list[str], bool]]:
    """Each step's host syncs, and whether it gave a request tokens, until every request is done."""
    for prompt, p in zip(prompts, params):
        llm.add_request({"prompt_token_ids": prompt}, p)
    per_step = []
    while not llm.is_finished():
        syncs.syncs = []
        with syncs:
            outputs = llm.step()
        per_step.append((syncs.syncs, bool(outputs)))
    return per_step


def assert_at_most(per_step: list[tuple[list[str], bool]], bound: int) -> None:
    worst = max((step for step, _ in per_step), key=len)
    print("host syncs per step:", [len(step) for step, _ in per_step])
    assert len(worst) <= bound, f"{len(worst)} host syncs in a step:\n" + "\n".join(worst)
    assert all(step for step, sampled in per_step if sampled)  # the counter sees each step's transfer


def prompts_of(lengths: list[int], seed: int, repeat: bool = False) -> list[list[int]]:
    """Random prompts; with `repeat`, a passage repeated, so that n-gram lookup finds proposals."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in lengths]
    return [p * 3 + p[:len(p) // 2] for p in prompts] if repeat else prompts


def test_plain_sampling_with_logprobs_syncs_once_per_step(tied_model, syncs):
    params = [SamplingParams(temperature=0.8, max_tokens=6, logprobs=2),
              SamplingParams(temperature=0, max_tokens=6, logprobs=0),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=6),
              SamplingParams(temperature=0.7, repetition_penalty=1.2, max_tokens=6, logprobs=1)]
    with LLM(tied_model, **SETTINGS) as llm:
        assert_at_most(run_steps(llm, prompts_of([5, 9, 3, 12], seed=1), params, syncs), 1)


def test_ngram_speculation_with_sampling_syncs_once_per_step(tied_model, syncs):
    """Point-mass drafts verified by the sampler (unseeded sampling, logprobs asked)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    params = [SamplingParams(temperature=0.5, max_tokens=24, ignore_eos=True, logprobs=1)] * 3
    with LLM(tied_model, speculative_config=spec, **SETTINGS) as llm:
        per_step = run_steps(llm, prompts_of([6, 9, 12], seed=2, repeat=True), params, syncs)
        assert llm.stats()["num_draft_tokens"] > 0
    assert_at_most(per_step, 1)


def test_draft_model_sampling_syncs_once_for_its_drafts_and_once_for_the_step(tied_model, syncs, monkeypatch,
                                                                               tmp_path):
    """Sampled drafts four deep (speculative sampling on the device), beside a greedy sequence's point masses and
    a sequence whose multi-token bad words are matched against the drafts on the device: the drafts reach the host
    once, after the last depth (the target's input ids are built on the host), and the step's results once."""
    monkeypatch.setattr(DraftModel, "forward_ratio", lambda self, num_seqs: 0.0)  # always speculate
    monkeypatch.setattr("nanovllm.engine.llm_engine.LLMEngine._bad_word_ids", lambda self, params: [[7, 8], [9]])
    draft = make_checkpoint(str(tmp_path / "draft"), seed=5, num_layers=1, hidden_size=32, num_heads=2,
                            num_kv_heads=1, head_dim=16, intermediate_size=64)
    spec = {"model": draft, "num_speculative_tokens": 4}
    params = [SamplingParams(temperature=1.5, max_tokens=32, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, top_k=30, max_tokens=32, ignore_eos=True, bad_words=["x"]),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)]
    with LLM(tied_model, speculative_config=spec, **SETTINGS) as llm:
        per_step = run_steps(llm, prompts_of([7, 11, 5], seed=3), params, syncs)
        stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # drafts accepted and rejected
    assert_at_most(per_step, 2)  # the drafts must be on the host before the target's forward packs its input ids


def test_prompt_logprobs_come_with_the_steps_samples(tied_model, syncs):
    """Prompt chunks scored in steps that also sample (chunked prefill beside decodes, then the prompt's last chunk)."""
    params = [SamplingParams(temperature=0.8, max_tokens=4, prompt_logprobs=2, logprobs=1),
              SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0)]
    with LLM(tied_model, max_num_batched_tokens=16, **SETTINGS) as llm:
        per_step = run_steps(llm, prompts_of([40, 6], seed=4), params, syncs)
    assert_at_most(per_step, 1)


def test_drafts_on_the_device_meet_bad_words_as_on_the_host():
    """`masked` with a row's last tokens on the device (a draft model's drafts) bans what it bans when they are
    known on the host."""
    from nanovllm.execution.sampler import DeviceTail

    rng = random.Random(5)
    vocab = 12
    for _ in range(200):
        rows, known, tails, tokens = [], [], [], []
        for seq_id in range(rng.randint(1, 4)):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            completion = [rng.randrange(3) for _ in range(rng.randint(0, 5))]
            drafts = [rng.randrange(3) for _ in range(rng.randint(0, 4))]
            words = [[rng.randrange(3) for _ in range(rng.randint(1, 4))] + [rng.randrange(vocab)]
                     for _ in range(rng.randint(0, 3))]
            params = SamplingParams(temperature=1.0)
            params.bad_words_token_ids = words
            known.append(SamplingRow(seq_id, params, prompt + completion + drafts, len(prompt)))
            rows.append(SamplingRow(seq_id, params, prompt + completion + [0] * len(drafts), len(prompt)))
            order = list(range(len(tokens), len(tokens) + len(drafts)))
            tails.append(order)
            tokens += drafts
        shuffled = list(range(len(tokens)))
        rng.shuffle(shuffled)  # the tail's tokens lie anywhere in its tensor
        where = {old: new for new, old in enumerate(shuffled)}
        device = torch.tensor([tokens[i] for i in shuffled], dtype=torch.int64)
        logits = torch.randn(len(rows), vocab)
        sampler = Sampler(vocab, [], "cpu")
        ours = sampler.masked(logits, rows, DeviceTail(device, [[where[i] for i in tail] for tail in tails]))
        assert torch.equal(ours, sampler.masked(logits, known))


def test_a_draft_models_tail_finds_each_sequences_earlier_drafts():
    """Depth t's tokens hold one per sequence with more than t drafts; each sequence still drafting at depth j finds
    its drafts 0 to j - 1 among them."""
    lengths = [3, 1, 4, 2]
    speculating = [(None, 0, [0] * n) for n in lengths]
    drawn = [torch.tensor([10 * t + s for s, n in enumerate(lengths) if n > t]) for t in range(max(lengths))]
    for j in range(1, max(lengths)):
        tail = DraftModel._tail(speculating, drawn[:j], j)
        assert [tail.tokens[index].tolist() for index in tail.index] == \
            [[10 * t + s for t in range(j)] for s, n in enumerate(lengths) if n > j]
