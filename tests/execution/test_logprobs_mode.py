"""vLLM's `logprobs_mode` engine setting: what logprobs and prompt logprobs hold, against a direct computation from
transformers' logits on the same weights. "raw": the model's logits; "processed": the logits a token is drawn from
(vLLM V1's sampler: penalties, then temperature and top-k for rows that sample; a greedy row's are its penalized
logits, since vLLM resets a greedy request's top-k); "*_logprobs": their log-softmax, "*_logits": themselves. Prompt
tokens are not sampled, so their values are raw in every mode. The tokens drawn do not depend on the mode, with or
without speculative decoding, and a step's results still reach the host in one transfer."""
import math

import pytest
import torch
from test_host_syncs import HostSyncs, assert_at_most, prompts_of, run_steps
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.config import LOGPROBS_MODES, Config
from nanovllm.execution import sampler as sampler_module
from nanovllm.execution.draft_model import DraftModel

SETTINGS = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, max_logprobs=-1)
PROMPTS = [[5, 17, 42, 42, 9, 130, 17, 250], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
# sampled: temperature 0.5, top-k 5 and a repetition penalty, seeded; greedy: the penalty, and a top-k that greedy
# sampling ignores (vLLM resets it)
SAMPLED = SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.3, seed=11, max_tokens=8, ignore_eos=True,
                         logprobs=-1)
GREEDY = SamplingParams(temperature=0, top_k=5, repetition_penalty=1.3, max_tokens=8, ignore_eos=True, logprobs=-1)


@pytest.fixture(scope="module")
def reference(tied_model):
    return AutoModelForCausalLM.from_pretrained(tied_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(tied_model):
    """One engine per mode."""
    llms = {mode: LLM(tied_model, logprobs_mode=mode, **SETTINGS) for mode in LOGPROBS_MODES}
    yield llms
    for llm in llms.values():
        llm.exit()


@torch.inference_mode()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `token_ids` (row i predicts token i + 1)."""
    return model(torch.tensor([token_ids])).logits[0].float()


def processed(logits: torch.Tensor, params: SamplingParams, context: list[int]) -> torch.Tensor:
    """What vLLM V1's sampler draws a token from, computed here on its own: the repetition penalty on every token of
    `context` (prompt and completion so far: positive logits divided, the others multiplied), then for a sampling
    request the temperature and top-k (the k largest kept, the rest at -inf)."""
    row = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(context)))
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if params.temperature == 0:
        return row
    row = row / params.temperature
    if 0 < params.top_k < row.numel():
        row = row.masked_fill(row < row.topk(params.top_k).values[-1], -math.inf)
    return row


def expected_values(logits: torch.Tensor, mode: str) -> torch.Tensor:
    return logits.log_softmax(-1) if mode.endswith("logprobs") else logits


def assert_values(ranked: dict, values: torch.Tensor, token: int, vocab_size: int) -> None:
    """`ranked` (one position's logprobs, the whole vocabulary) holds `values`, the token's rank among them."""
    assert len(ranked) == vocab_size and next(iter(ranked)) == token
    for token_id, lp in ranked.items():
        want = values[token_id].item()
        if want == -math.inf:
            assert lp.logprob == -math.inf, token_id
        else:
            assert lp.logprob == pytest.approx(want, abs=2e-4), token_id
    assert ranked[token].rank == int((values >= values[token]).sum())


def assert_completion(model, prompt: list[int], completion, params: SamplingParams, mode: str) -> None:
    """Each completion token's logprobs in `mode`, computed from transformers' logits of the prompt and the
    completion."""
    logits = hf_logits(model, prompt + completion.token_ids)[len(prompt) - 1:-1]
    assert len(completion.logprobs) == len(completion.token_ids) == params.max_tokens
    chosen = []
    for step, (token, ranked) in enumerate(zip(completion.token_ids, completion.logprobs)):
        scores = processed(logits[step], params, prompt + completion.token_ids[:step]) \
            if mode.startswith("processed") else logits[step]
        values = expected_values(scores, mode)
        assert_values(ranked, values, token, logits.size(1))
        chosen.append(values[token].item())
    assert completion.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-3)


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_sampled_logprobs_follow_the_mode(engines, reference, mode):
    """A sampled and a greedy request in one batch, then the greedy one alone (the sampler's all-greedy path): every
    value of the vocabulary at every step, and the sampled token's rank, as computed from transformers' logits."""
    llm = engines[mode]
    sampled, greedy = llm.generate(PROMPTS, [SAMPLED, GREEDY], use_tqdm=False)
    assert_completion(reference, PROMPTS[0], sampled.outputs[0], SAMPLED, mode)
    assert_completion(reference, PROMPTS[1], greedy.outputs[0], GREEDY, mode)
    alone = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == greedy.outputs[0].token_ids
    for ours, batched in zip(alone.logprobs, greedy.outputs[0].logprobs):
        assert ours.keys() == batched.keys()
        assert all(ours[t].logprob == pytest.approx(batched[t].logprob, abs=1e-5) for t in ours)
    if mode.startswith("processed"):  # top-k 5: the sampled request's other tokens are out
        assert all(sum(lp.logprob > -math.inf for lp in ranked.values()) == 5 for ranked in sampled.outputs[0].logprobs)


def test_tokens_do_not_depend_on_the_mode(engines):
    """Seeded sampling and greedy decoding give the same tokens in every mode; vLLM's own check of the modes
    (tests/v1/sample/test_logprobs.py, `test_logprobs_mode`): log-probabilities are never positive, and logits are
    (some of them)."""
    outputs = {mode: llm.generate(PROMPTS, [SAMPLED, GREEDY], use_tqdm=False) for mode, llm in engines.items()}
    tokens = {mode: [o.outputs[0].token_ids for o in outs] for mode, outs in outputs.items()}
    assert all(t == tokens["raw_logprobs"] for t in tokens.values())
    for mode, outs in outputs.items():
        values = [lp.logprob for o in outs for ranked in o.outputs[0].logprobs for lp in ranked.values()]
        if mode.endswith("logprobs"):
            assert max(values) <= 0
        else:
            assert max(values) > 0


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_prompt_logprobs_are_raw_in_every_mode(engines, reference, mode):
    """Prompt logprobs of a request whose sampling would process its logits: the log-softmax of transformers'
    logits in the "*_logprobs" modes, the logits themselves in the "*_logits" ones."""
    params = SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.3, seed=2, max_tokens=2,
                            prompt_logprobs=-1)
    prompt = PROMPTS[1]
    out = engines[mode].generate([prompt], params, use_tqdm=False)[0]
    values = expected_values(hf_logits(reference, prompt)[:-1], mode)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, ranked in enumerate(out.prompt_logprobs[1:]):
        assert_values(ranked, values[position], prompt[position + 1], values.size(1))


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_ngram_speculation_keeps_the_tokens_and_logprobs(tied_model, engines, mode):
    """vLLM's `test_spec_decode_logprobs`: with speculative decoding (n-gram drafts, verified by the sampler), each
    accepted token's logprobs are those without it, in every mode (greedy and seeded sampling: the same tokens)."""
    prompts = prompts_of([6, 9], seed=2, repeat=True)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.7, top_k=5, seed=4, max_tokens=24, ignore_eos=True, logprobs=3)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(tied_model, logprobs_mode=mode, speculative_config=spec, **SETTINGS) as llm:
        speculated = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["num_accepted_tokens"] > 0
    plain = engines[mode].generate(prompts, params, use_tqdm=False)
    for ours, theirs in zip(speculated, plain):
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert list(a) == list(b)
            for token_id in a:
                assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-4)
                assert a[token_id].rank == b[token_id].rank


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_draft_model_speculative_sampling_logprobs_follow_the_mode(tied_model, reference, monkeypatch, mode):
    """Sampled drafts (an unseeded request, the model drafting for itself, so most drafts are accepted) verified by
    speculative sampling: each accepted token's values as computed from transformers' logits."""
    monkeypatch.setattr(DraftModel, "forward_ratio", lambda self, num_seqs: 0.0)  # always speculate
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=12, ignore_eos=True, logprobs=-1)
    spec = {"model": tied_model, "num_speculative_tokens": 3}
    with LLM(tied_model, logprobs_mode=mode, speculative_config=spec, **SETTINGS) as llm:
        out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
        assert llm.stats()["num_accepted_tokens"] > 0
    assert_completion(reference, PROMPTS[0], out, params, mode)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_modes_sync_once_per_step(tied_model, monkeypatch, mode):
    """Sampling, n-gram verification and prompt logprobs in the processed modes: still one transfer per step."""
    syncs = HostSyncs()
    monkeypatch.setattr(sampler_module, "to_host", syncs.counting(sampler_module.to_host))
    monkeypatch.setattr(sampler_module.Sampler, "reads_cost_nothing", False)  # the paths a CUDA device takes
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=2),
              SamplingParams(temperature=0.7, repetition_penalty=1.2, max_tokens=8, logprobs=0)]
    with LLM(tied_model, logprobs_mode=mode, speculative_config=spec, max_num_batched_tokens=16,
             **SETTINGS) as llm:
        assert_at_most(run_steps(llm, prompts_of([5, 30, 4], seed=1, repeat=True), params, syncs), 1)


def test_an_invalid_mode_is_refused_naming_the_valid_ones(tied_model):
    valid = r"\['raw_logits', 'raw_logprobs', 'processed_logits', 'processed_logprobs'\]"
    assert Config("unused").logprobs_mode == "raw_logprobs"
    with pytest.raises(ValueError, match=f"logprobs_mode must be one of {valid}, got 'logits'"):
        Config("unused", logprobs_mode="logits")  # at construction, before the model is looked at
    with pytest.raises(ValueError, match=f"logprobs_mode must be one of {valid}, got None"):
        LLM(tied_model, logprobs_mode=None, device="cpu")
