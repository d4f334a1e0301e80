"""Drafts under a grammar and exact jump-forward, with a tiny random model: drafts the grammar rejects are cut before
the step, the mask of every draft position is the grammar after the drafts before it, forced tokens are proposed,
and constrained output is token for token the same with and without jump-forward and n-gram speculation (mixed
batches, preemption), sampled output always valid, every block freed."""
import json
from types import SimpleNamespace

import pytest
import regex
import torch
from grammar_backends import GRAMMAR_BACKENDS
from test_mask import prompts_of
from transformers import AutoTokenizer

from benchmarks.structured_jump import compare_jump_forward
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.core.sequence import Sequence
from nanovllm.execution.model_runner import ModelRunner
from nanovllm.spec_decode.grammar_drafts import GrammarDrafts
from nanovllm.structured_output.backends import check_constraint
from nanovllm.structured_output.manager import StructuredOutputs

EOS = 0
FORCING = r"(red fox|brown dog) jumps over the (lazy|quick) cat\."
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "quick": {"type": "boolean"},
    "animal": {"enum": ["brown fox", "lazy dog"]},
    "primes": {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 3}},
    "required": ["name", "quick", "animal", "primes"], "additionalProperties": False}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def tokenizer(tied_model):
    return AutoTokenizer.from_pretrained(tied_model)


def constrained_seq(manager: StructuredOutputs, tokenizer, pattern: str, text: str = "") -> Sequence:
    """A sequence under `pattern` whose completion so far is `text` (accepted by its grammar), about to decode."""
    seq = Sequence(0, tokenizer.encode("The quick brown fox"), 16, SamplingParams(temperature=0))
    seq.grammar = manager.state(check_constraint(StructuredOutputsParams(regex=pattern), manager.backend_name))
    seq.grammar.compiled.result()
    for token_id in tokenizer.encode(text):
        seq.append_token(token_id)
        assert seq.grammar.matcher.accept(token_id)
    seq.num_computed_tokens = len(seq) - 1
    return seq


def mask_rows(manager: StructuredOutputs, rows: list) -> tuple[list[int], torch.Tensor]:
    mask = manager.bitmask(rows)
    return mask.rows, mask.words().clone()


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_drafts_the_grammar_rejects_are_cut_and_leave_its_state_alone(tokenizer, backend):
    manager = StructuredOutputs(backend, tokenizer, 384, {EOS}, max_rows=4)
    seq = constrained_seq(manager, tokenizer, r"[a-z]+ [0-9]+!")
    words, digits = tokenizer.encode("fox"), tokenizer.encode("12")
    before = mask_rows(manager, [(seq, [])])[1]
    seq.spec_token_ids = words + digits + tokenizer.encode(" 7")  # "fox12 7": the digits break the pattern
    GrammarDrafts(jump_forward=False, max_model_len=256).propose([seq], proposed=True)
    assert seq.spec_token_ids == words
    assert torch.equal(mask_rows(manager, [(seq, [])])[1], before)
    seq.spec_token_ids = words + tokenizer.encode(" 7!") + [EOS, EOS]  # EOS: the model samples it itself
    GrammarDrafts(jump_forward=False, max_model_len=256).propose([seq], proposed=True)
    assert tokenizer.decode(seq.spec_token_ids) == "fox 7!"
    rows, words_after = mask_rows(manager, [(seq, seq.spec_token_ids)])
    assert len(rows) == len(seq.spec_token_ids) + 1
    assert words_after[-1, 0] == 1 << EOS and not words_after[-1, 1:].any()  # after "!": EOS only
    GrammarDrafts(jump_forward=False, max_model_len=256).propose([seq], proposed=False)
    assert seq.spec_token_ids == []  # no proposer this step: an earlier step's drafts are dropped


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_each_draft_rows_mask_is_the_grammar_after_the_drafts_before_it(tokenizer, backend):
    manager = StructuredOutputs(backend, tokenizer, 384, {EOS}, max_rows=1)
    pattern = r"([a-z]{1,6} ){2,5}(cat|dog)\."
    first = constrained_seq(manager, tokenizer, pattern, "the ")
    second = constrained_seq(manager, tokenizer, pattern)
    drafts = tokenizer.encode("quick brown ")
    plain = SimpleNamespace(grammar=None)
    rows, words = mask_rows(manager, [(first, drafts), (plain, [5, 6]), (second, [])])
    assert rows == [*range(len(drafts) + 1), len(drafts) + 4]
    expected = []
    for j in range(len(drafts) + 1):
        alone = constrained_seq(manager, tokenizer, pattern, "the " + tokenizer.decode(drafts[:j]))
        expected.append(mask_rows(manager, [(alone, [])])[1][0])
    expected.append(mask_rows(manager, [(second, [])])[1][0])
    assert torch.equal(words, torch.stack(expected))
    assert len({tuple(row.tolist()) for row in expected}) > 2  # the rows differ: each is its own position's
    assert torch.equal(mask_rows(manager, [(first, [])])[1][0], expected[0])  # filling left the grammar alone


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_forced_tokens_are_proposed_and_a_proposal_that_continues_them_is_kept(tokenizer, backend):
    manager = StructuredOutputs(backend, tokenizer, 384, {EOS}, max_rows=1)
    jump = GrammarDrafts(jump_forward=True, max_model_len=256)
    seq = constrained_seq(manager, tokenizer, FORCING, "red fox")
    jump.propose([seq], proposed=False)
    forced = seq.spec_token_ids
    assert forced and " jumps over the ".startswith(tokenizer.decode(forced))
    seq.spec_token_ids = tokenizer.encode(" the lazy")  # a proposal that contradicts the grammar gives way
    jump.propose([seq], proposed=True)
    assert seq.spec_token_ids == forced
    longer = forced + tokenizer.encode(" jumps over the lazy"[len(tokenizer.decode(forced)):])
    seq.spec_token_ids = longer
    jump.propose([seq], proposed=True)
    assert seq.spec_token_ids == longer
    seq.params = SamplingParams(temperature=0, max_tokens=seq.num_completion_tokens + 2)
    jump.propose([seq], proposed=False)
    assert seq.spec_token_ids == forced[:1]  # a step yields one token past its drafts: room for one


def run(model: str, prompts: list, params: list, **settings) -> tuple[list[list[int]], list, dict]:
    """Each request's tokens, its completion, and the engine's stats (after checking every block is free)."""
    settings = dict(dict(device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256), **settings)
    with LLM(model, **settings) as llm:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    return [o.token_ids for o in outputs], outputs, stats


def mixed_batch(tokenizer) -> tuple[list, list]:
    """Unconstrained, greedy constrained and seeded sampled constrained requests (JSON and a forcing regex), some
    with prompts that repeat themselves so that n-gram lookup proposes."""
    passage = prompts_of(tokenizer, 1)[0]
    prompts = [passage * 4] + prompts_of(tokenizer, 5) + [passage * 3]
    schema = StructuredOutputsParams(json=SCHEMA)
    forcing = StructuredOutputsParams(regex=FORCING)
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=96, structured_outputs=schema),
              SamplingParams(temperature=0, max_tokens=48, structured_outputs=forcing),
              SamplingParams(temperature=1.0, seed=3, max_tokens=96, structured_outputs=schema),
              SamplingParams(temperature=0.8, seed=4, max_tokens=48, structured_outputs=forcing),
              SamplingParams(temperature=0, max_tokens=96,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=48, structured_outputs=forcing)]
    return prompts, params


def assert_valid(completions: list, params: list) -> None:
    """Complete outputs satisfy their constraint; the others were cut by max_tokens (a random model's JSON often
    runs on in whitespace)."""
    for completion, p in zip(completions, params):
        constraint, text = p.structured_outputs, completion.text
        if constraint is None:
            continue
        if constraint.regex is not None:
            assert regex.fullmatch(constraint.regex, text, partial=completion.finish_reason == "length"), text
            continue
        assert text.startswith("{"), text
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            assert completion.finish_reason == "length", text
            continue
        assert completion.finish_reason == "stop"
        assert set(value) == set(SCHEMA["required"]) and value["animal"] in ("brown fox", "lazy dog"), text


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_output_is_the_same_with_and_without_jump_forward_and_speculation(tied_model, tokenizer, backend):
    prompts, params = mixed_batch(tokenizer)
    off = {"backend": backend, "jump_forward": False}
    expected, completions, _ = run(tied_model, prompts, params, structured_outputs_config=off)
    assert_valid(completions, params)
    jumped, _, jump_stats = run(tied_model, prompts, params, structured_outputs_config={"backend": backend})
    assert jumped == expected
    assert jump_stats["num_accepted_tokens"] > 0
    speculated, _, spec_stats = run(tied_model, prompts, params, structured_outputs_config={"backend": backend},
                                    speculative_config=NGRAM)
    assert speculated == expected
    assert spec_stats["num_accepted_tokens"] > jump_stats["num_accepted_tokens"]
    assert spec_stats["num_steps"] < jump_stats["num_steps"]


def test_forced_tokens_are_dropped_where_a_verify_step_costs_too_much(tied_model, tokenizer, monkeypatch):
    """Jump-forward's forced tokens are drafts: where a step verifying them costs more than they bring (on CUDA, no
    graph replays it), the step runs without them, and the output is the same."""
    prompts, params = mixed_batch(tokenizer)
    expected, _, _ = run(tied_model, prompts, params, structured_outputs_config={"jump_forward": False})
    monkeypatch.setattr(ModelRunner, "verify_cost", lambda self, running: 1000.0)
    priced, completions, stats = run(tied_model, prompts, params)
    assert priced == expected
    assert stats["num_draft_tokens"] == 0
    assert_valid(completions, params)


def test_a_draft_model_leaves_constrained_sequences_their_forced_tokens(tied_model, tokenizer):
    """A draft model proposes for the unconstrained requests only: the constrained ones keep the forced tokens their
    masks were built for (the drafts replacing them would be verified under the wrong masks)."""
    prompts, params = mixed_batch(tokenizer)
    expected, _, _ = run(tied_model, prompts, params, structured_outputs_config={"jump_forward": False})
    draft = {"model": tied_model, "quantization": "int8", "num_speculative_tokens": 4}
    drafted, completions, stats = run(tied_model, prompts, params, speculative_config=draft)
    assert drafted == expected
    assert stats["num_accepted_tokens"] > 0
    assert_valid(completions, params)


def test_preemption_and_chunked_prefill_with_drafts_mid_grammar_keep_outputs_exact(tied_model, tokenizer):
    prompts, params = mixed_batch(tokenizer)
    expected, _, _ = run(tied_model, prompts, params, structured_outputs_config={"jump_forward": False})
    tight, completions, stats = run(tied_model, prompts, params, speculative_config=NGRAM, num_kvcache_blocks=8,
                              max_model_len=128, max_num_batched_tokens=24)
    assert stats["num_preemptions"] > 0 and stats["num_chunked_steps"] > 0 and stats["num_accepted_tokens"] > 0
    assert tight == expected
    assert_valid(completions, params)


def test_sampled_constrained_outputs_are_always_valid_with_drafts(tied_model, tokenizer):
    prompts = prompts_of(tokenizer, 6)
    params = [SamplingParams(temperature=1.2, seed=None if i % 2 else i, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(regex=FORCING)) for i in range(6)]
    _, completions, stats = run(tied_model, prompts * 2, params * 2, speculative_config=NGRAM)
    assert stats["num_draft_tokens"] > 0
    assert_valid(completions, params * 2)


def test_the_benchmarks_comparison_counts_fewer_steps_and_identical_outputs(tied_model, tokenizer):
    prompts = prompts_of(tokenizer, 4)
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(regex=FORCING))
    settings = dict(device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256)
    with LLM(tied_model, structured_outputs_config={"jump_forward": False}, **settings) as off, \
            LLM(tied_model, structured_outputs_config={"jump_forward": True}, **settings) as on:
        figures = compare_jump_forward({"off": off, "on": on}, prompts, lambda run: [params] * 4, repeat=2)
    off, on = figures["off"], figures["on"]
    assert figures["identical"] and off["num_draft_tokens"] == 0 and on["num_accepted_tokens"] > 0
    assert on["steps_per_token"] < off["steps_per_token"] and on["request_passes_per_token"] < 1
