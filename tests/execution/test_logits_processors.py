"""vLLM V1's custom logits processors (`LLM(logits_processors=[...])`), written as vLLM's examples write them with
`vllm` replaced by `nanovllm` in the imports: a processor class given as a class or a "module:Class" name, per-request
arguments in `SamplingParams.extra_args`, the adapter for per-request callables. In a mixed batch under chunked
prefill and preemption the requests they touch get the tokens they force and the others the tokens of a run without
them; the batch they are told about stays consistent (every index live, one request per index, output lists that
grow with the tokens); `validate_params` refuses bad arguments at submission; per-request processors and
speculative decoding are refused as vLLM V1 refuses them."""
import random
import re
import sys
import types
from pathlib import Path

import pytest
import test_host_syncs
import torch
from test_host_syncs import HostSyncs, assert_at_most, prompts_of, run_steps

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.config import Config, VllmConfig
from nanovllm.execution import sampler as sampler_module
from nanovllm.execution.logits_processors import ProcessorBatch
from nanovllm.execution.sampler import SamplingRow
from nanovllm.logger import init_logger
from nanovllm.v1.sample.logits_processor import (
    STR_POOLING_REJECTS_LOGITSPROCS,
    STR_SPEC_DEC_REJECTS_LOGITSPROCS,
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
)
from nanovllm.v1.sample.logits_processor.builtin import process_dict_updates

logger = init_logger(__name__)
VOCAB = 384
# small KV cache (16 blocks of 16 tokens) and a 16-token budget: chunked prefill, mixed steps and preemption
TIGHT = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=256,
             max_num_batched_tokens=16)


def force(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Every token of `rows` but its token in `tokens` at -inf (the value of the one kept is left as it was)."""
    kept = logits[rows, tokens].clone()
    logits[rows] = float("-inf")
    logits[rows, tokens] = kept
    return logits


class TargetToken(LogitsProcessor):
    """vLLM's example processor: a request with `extra_args={"target_token": t}` gets t at every step."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.targets: dict[int, int] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        target = (params.extra_args or {}).get("target_token")
        if target is not None and not (isinstance(target, int) and 0 <= target < VOCAB):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.targets, batch_update,
                             lambda params, _, __: params.extra_args and params.extra_args.get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.targets:
            return logits
        assert logits.size(0) <= self.max_num_seqs
        rows = torch.tensor(list(self.targets), dtype=torch.long, device=logits.device)
        return force(logits, rows, torch.tensor(list(self.targets.values()), dtype=torch.long, device=logits.device))


class ForceOne:
    """A per-request processor (vLLM's example's): the row keeps only its `target`."""

    def __init__(self, target: int):
        self.target = target

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        kept = logits[self.target].item()
        logits[:] = float("-inf")
        logits[self.target] = kept
        return logits


class TargetTokenAdapter(AdapterLogitsProcessor):
    """vLLM's adapter example: the same per request, through a per-request callable."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        target = params.extra_args and params.extra_args.get("target_token")
        if target is None:
            return None
        if not isinstance(target, int):
            logger.warning("target_token %s is not an int: not applied", target)
            return None
        return ForceOne(target)


class CudaOnlyAdapter(TargetTokenAdapter):
    """vLLM's custom_req_init example: `__init__` overridden to read the device; it applies on CUDA only."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        super().__init__(vllm_config, device, is_pin_memory)
        self.is_cuda = device.type == "cuda"

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        return super().new_req_logits_processor(params) if self.is_cuda else None


class CountingAdapter(AdapterLogitsProcessor):
    """A three-argument per-request callable: with `extra_args={"count_on": True}` a request's k-th token is its last
    prompt token + 1 + k, read from the prompt and the length of its output list (which must be live)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        if not (params.extra_args or {}).get("count_on"):
            return None

        def count_on(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            return ForceOne((prompt_ids[-1] + 1 + len(output_ids)) % VOCAB)(output_ids, logits)

        return count_on


class Recorder(LogitsProcessor):
    """Checks every batch update against the batch it keeps (index -> the request's output list): removed and moved
    indices were live, no request is at two indices, the indices are 0 to batch_size - 1 afterwards, and `apply`
    gets one row per index. Forces `extra_args={"count_from": c}`: a request's next token is c + its output count."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.live: dict[int, list[int]] = {}
        self.params: dict[int, SamplingParams] = {}
        self.prompts: dict[int, list[int]] = {}
        self.batch_size = 0
        self.added: list[tuple[list[int], int]] = []  # (the request's output list, its length when added)
        self.num_moved = self.num_removed = self.num_updates = self.num_none = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            self.num_none += 1
            return
        self.num_updates += 1
        assert list(batch_update.removed) == sorted(batch_update.removed, reverse=True)
        for i in batch_update.removed:
            assert i in self.live, f"removed index {i} was not live"
            del self.live[i], self.params[i], self.prompts[i]
            self.num_removed += 1
        for i, params, prompt, output in batch_update.added:
            assert 0 <= i < batch_update.batch_size and isinstance(prompt, list) and isinstance(output, list)
            assert all(output is not other for j, other in self.live.items() if j != i), "a request at two indices"
            self.live[i], self.params[i], self.prompts[i] = output, params, prompt
            self.added.append((output, len(output)))
        for a, b, how in batch_update.moved:
            assert a in self.live and 0 <= b < batch_update.batch_size
            for state in (self.live, self.params, self.prompts):
                if how == MoveDirectionality.SWAP:
                    state[a], state[b] = state[b], state[a]
                else:
                    state[b] = state.pop(a)
            self.num_moved += 1
        assert sorted(self.live) == list(range(batch_update.batch_size)), (sorted(self.live), batch_update)
        self.batch_size = batch_update.batch_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.size(0) == self.batch_size == len(self.live)
        forced = {i: (p.extra_args["count_from"] + len(self.live[i])) % VOCAB for i, p in self.params.items()
                  if p.extra_args and "count_from" in p.extra_args}
        if not forced:
            return logits
        rows = torch.tensor(list(forced), dtype=torch.long, device=logits.device)
        return force(logits, rows, torch.tensor(list(forced.values()), dtype=torch.long, device=logits.device))


# "module:Class" names are imported: this module stands for the user's
PLUGIN = types.ModuleType("nanovllm_test_plugin")
PLUGIN.TargetToken = TargetToken
PLUGIN.Recorder = Recorder


@pytest.fixture(autouse=True)
def plugin_module(monkeypatch):
    monkeypatch.setitem(sys.modules, PLUGIN.__name__, PLUGIN)


def mixed_requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Requests the processors touch (target_token, count_from, count_on) beside ones they leave alone: greedy,
    seeded samples (n=2 too), logprobs, a structured output; prompts of 3 to 120 tokens."""
    prompts = prompts_of([40, 40, 40, 120, 7, 25, 3, 12, 30], seed=7)
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = dict(temperature=0.8, top_k=50, max_tokens=40, ignore_eos=True)
    params = [SamplingParams(**greedy, logprobs=1, extra_args={"target_token": 128}),
              SamplingParams(**greedy, logprobs=2),
              SamplingParams(**greedy, extra_args={"count_from": 50}),
              SamplingParams(**sampled, seed=7),
              SamplingParams(**sampled, seed=3, n=2, extra_args={"target_token": 67}),
              SamplingParams(**sampled, seed=5, extra_args={"count_from": 300, "unrelated": [1]}),
              SamplingParams(**greedy, extra_args={"count_on": True}),
              SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(choice=["Hello, my name is Ada", "fox"])),
              SamplingParams(**greedy, extra_args={"other": 1})]
    return prompts, params


def expected_tokens(prompt: list[int], params: SamplingParams, reference: list[int], targets: bool) -> list[int]:
    """A request's tokens with `Recorder` and `CountingAdapter` running, and a target-token processor that applies
    (`targets`) or not; `reference`: its tokens without processors."""
    args = params.extra_args or {}
    if "target_token" in args and targets:
        return [args["target_token"]] * params.max_tokens
    if "count_from" in args:
        return [(args["count_from"] + k) % VOCAB for k in range(params.max_tokens)]
    if "count_on" in args:
        return [(prompt[-1] + 1 + k) % VOCAB for k in range(params.max_tokens)]
    return reference


@pytest.fixture(scope="module")
def reference(tied_model) -> list:
    prompts, params = mixed_requests()
    with LLM(tied_model, **TIGHT) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("target, applies", [
    (TargetToken, True),
    ("nanovllm_test_plugin:TargetToken", True),
    (TargetTokenAdapter, True),
    (CudaOnlyAdapter, False),  # on the CPU it leaves every request alone, as vLLM's example says
])
def test_vllm_examples_in_a_mixed_batch_under_preemption_and_chunked_prefill(tied_model, reference, target, applies):
    prompts, params = mixed_requests()
    with LLM(tied_model, logits_processors=[target, "nanovllm_test_plugin:Recorder", CountingAdapter],
             **TIGHT) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.stats()
        recorder = llm.engine.model_runner.sampler.logits_processors.processors[1]
    assert stats["num_preemptions"] > 0 and stats["num_chunked_steps"] > 0 and stats["num_mixed_steps"] > 0
    for prompt, p, ours, theirs in zip(prompts, params, outputs, reference):
        for completion, expected in zip(ours.outputs, theirs.outputs):
            wanted = expected_tokens(prompt, p, expected.token_ids, applies)
            assert completion.token_ids == wanted, (p, completion.token_ids, wanted)
            if wanted == expected.token_ids:
                assert completion.logprobs == expected.logprobs and completion.text == expected.text
    assert outputs[7].outputs[0].text in ("Hello, my name is Ada", "fox")
    if applies:  # logprobs are the model's (raw_logprobs): the processors wrote on a copy
        assert all(step[128].logprob < 0 for step in outputs[0].outputs[0].logprobs)
    # preempted requests left the batch and came back with the tokens they had: the same list, not empty
    readded = [n for i, (output, n) in enumerate(recorder.added) if any(o is output for o, _ in recorder.added[:i])]
    assert readded and all(n > 0 for n in readded)
    assert recorder.num_removed > 0 and recorder.num_moved > 0 and recorder.num_none > 0


def test_the_batch_follows_the_steps_rows():
    """Random steps (sequences joining, leaving from anywhere, coming back, finishing, growing): each index's logits
    row is the sequence the processors were told of, its output list the sequence's own (the same list every step,
    up to date), and their changes land on the step's rows."""

    class Checker(Recorder):
        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            super().apply(logits)
            for i, output in self.live.items():
                seq_id = self.prompts[i][0]
                assert logits[i, 0] == seq_id and output == tokens[seq_id][1:]
                assert output is lists.setdefault(seq_id, output)
            logits[:, 1] = logits[:, 0] * 2
            return logits

    rng = random.Random(0)
    processor = Checker(None, torch.device("cpu"), False)
    batch = ProcessorBatch([processor], torch.device("cpu"))
    tokens = {seq_id: [seq_id] for seq_id in range(12)}  # a prompt of one token: the sequence's id
    lists: dict[int, list[int]] = {}
    next_id = len(tokens)
    for _ in range(400):
        step = rng.sample(sorted(tokens), min(len(tokens), rng.randint(0, 10)))
        rows = [SamplingRow(seq_id, SamplingParams(), list(tokens[seq_id]), 1) for seq_id in step]
        if rows:
            batch.update(rows)
            logits = torch.tensor([[float(seq_id), 0.0] for seq_id in step])
            out = batch.apply(logits, [processor], shared=True)
            assert out[:, 1].tolist() == [2.0 * seq_id for seq_id in step] and logits[:, 1].eq(0).all()
        for seq_id in step:
            tokens[seq_id].append(rng.randrange(VOCAB))
        if rng.random() < 0.15:  # a sequence finishes (maybe one outside this step), another arrives
            finished = rng.choice(sorted(tokens))
            del tokens[finished]
            lists.pop(finished, None)
            batch.release([finished])
            tokens[next_id] = [next_id]
            next_id += 1
    assert processor.num_moved > 0 and processor.num_removed > 0 and processor.num_none > 0
    assert len(batch.tokens) <= len(tokens), "finished sequences' lists are let go"


class ArgmaxOnly(LogitsProcessor):
    """Argmax-invariant: with `extra_args={"argmax_only": True}` a row keeps only its most likely token (so a
    sampled request gets its greedy tokens); counts the steps it ran in."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, bool] = {}
        self.calls = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update,
                             lambda params, _, __: (params.extra_args or {}).get("argmax_only"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.rows:
            rows = torch.tensor(list(self.rows), dtype=torch.long)
            force(logits, rows, logits[rows].argmax(dim=-1))
        return logits


def test_argmax_invariant_processors_run_after_temperature_only_when_sampling(tied_model):
    prompts = prompts_of([5, 9, 13], seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hot = dict(temperature=1.5, max_tokens=8, ignore_eos=True)
    with LLM(tied_model, device="cpu", dtype="float32", logits_processors=[ArgmaxOnly]) as llm:
        processor = llm.engine.model_runner.sampler.logits_processors.processors[0]
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert processor.calls == 0, "greedy steps skip argmax-invariant processors"
        params = [SamplingParams(**hot, seed=1, extra_args={"argmax_only": True}), SamplingParams(**hot, seed=2),
                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra_args={"argmax_only": True})]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert processor.calls > 0
    with LLM(tied_model, device="cpu", dtype="float32") as plain:
        untouched = plain.generate([prompts[1]], params[1], use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[0].outputs[0].token_ids == expected[0] and outputs[2].outputs[0].token_ids == expected[2]
    assert outputs[1].outputs[0].token_ids == untouched


def test_validate_params_refuses_bad_extra_args_at_submission(tied_model):
    with LLM(tied_model, device="cpu", dtype="float32", max_model_len=128,
             logits_processors=["nanovllm_test_plugin:TargetToken"]) as llm:
        for bad in ("x", VOCAB, -1):
            with pytest.raises(ValueError, match="target_token must be a token id"):
                llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=2),
                                                   SamplingParams(extra_args={"target_token": bad})], use_tqdm=False)
        assert llm.is_finished()  # nothing of the refused batch was queued
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, extra_args={"target_token": 9}),
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids == [9, 9, 9]


def test_what_vllm_v1_refuses(tied_model):
    with pytest.raises(ValueError, match="vLLM V1 does not support per request user provided logits processors"):
        SamplingParams(logits_processors=[lambda output_ids, logits: logits])
    assert SamplingParams(logits_processors=[]).extra_args is None
    with pytest.raises(ValueError, match="extra_args must be a dict or None, got list"):
        SamplingParams(extra_args=[1])
    assert SamplingParams(extra_args={"a": 1}, seed=2, n=2).for_sample(1).extra_args == {"a": 1}
    for spec in ({"method": "ngram", "num_speculative_tokens": 2}, {"model": "ngram", "num_speculative_tokens": 1}):
        with pytest.raises(ValueError, match=re.escape(STR_SPEC_DEC_REJECTS_LOGITSPROCS)):
            LLM(tied_model, device="cpu", speculative_config=spec, logits_processors=[TargetToken])
    with pytest.raises(ValueError, match=re.escape(STR_POOLING_REJECTS_LOGITSPROCS)):
        LLM(tied_model, device="cpu", runner="pooling", logits_processors=[TargetToken])
    for bad, message in [(["no_colon"], "must be a list of LogitsProcessor subclasses or their 'module:Class'"),
                         (TargetToken, "must be a list"),
                         (["nanovllm_no_such:X"], r"logits_processors\[0\] 'nanovllm_no_such:X' cannot be loaded"),
                         (["nanovllm_test_plugin:Missing"], "cannot be loaded"),
                         ([int], "must be a subclass of LogitsProcessor")]:
        with pytest.raises(ValueError, match=message):
            LLM(tied_model, device="cpu", dtype="float32", max_model_len=64, logits_processors=bad)
    config = Config(tied_model, logits_processors=[TargetToken], structured_outputs_config={"jump_forward": True})
    assert not config.jump_forward and Config(tied_model).jump_forward  # its drafts would skip the processors


@pytest.fixture
def syncs(monkeypatch) -> HostSyncs:
    """`test_host_syncs`' counter, counting this machinery's reads too."""
    mode = HostSyncs()
    monkeypatch.setattr(sampler_module, "to_host", mode.counting(sampler_module.to_host))
    counted = str(Path(sampler_module.__file__).with_name("logits_processors.py"))
    monkeypatch.setattr(test_host_syncs, "COUNTED", test_host_syncs.COUNTED | {counted})
    return mode


class QuietTargetToken(TargetToken):
    """`TargetToken` without a host sync of its own: its index tensors are built in `update_state`."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        super().update_state(batch_update)
        self.index = (torch.tensor(list(self.targets), dtype=torch.long),
                      torch.tensor(list(self.targets.values()), dtype=torch.long))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return force(logits, *self.index) if self.targets else logits


def test_one_host_transfer_per_step(tied_model, syncs, monkeypatch):
    """Processors of both kinds, rows gathered out of order (requests of different lengths leave from the middle)."""
    gathered, update = [], ProcessorBatch.update

    def noting(self, seqs):
        update(self, seqs)
        gathered.append(self.order is not None)

    monkeypatch.setattr(ProcessorBatch, "update", noting)
    params = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True, logprobs=1,
                             extra_args={"target_token": 5} if n % 2 else None) for n in (3, 9, 5, 12, 7)]
    with LLM(tied_model, logits_processors=[QuietTargetToken, ArgmaxOnly], **test_host_syncs.SETTINGS) as llm:
        per_step = run_steps(llm, prompts_of([5, 9, 3, 12, 4], seed=1), params, syncs)
    assert_at_most(per_step, 1)
    assert any(gathered) and not all(gathered)
