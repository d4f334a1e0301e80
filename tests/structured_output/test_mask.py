"""Structured outputs at the token level, with tiny random models: the mask never lets a token through that the
constraint forbids, and changes nothing else (the constrained argmax, unconstrained batch mates, preemption, chunked
prefill, the grammar cache)."""
import random
from types import SimpleNamespace

import pytest
import regex
import torch
from checkpoints import make_checkpoint
from grammar_backends import GRAMMAR_BACKENDS
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.core.scheduler import Scheduler, SchedulerConfig
from nanovllm.core.sequence import Sequence
from nanovllm.structured_output.backends import check_constraint
from nanovllm.structured_output.bitmask import TokenBitmask, apply_token_bitmask
from nanovllm.structured_output.manager import StructuredOutputs

ATOMS = [r"[a-z]", r"[0-9]", r"[A-Z][a-z]+", "fox", "the", r"[0-9]+", " ", ", ", "(cat|dog|sun)", r"[aeiou]{2}"]
EOS = 0


def random_regex(rng: random.Random) -> str:
    pattern = "".join(f"({rng.choice(ATOMS)})" + rng.choice(["", "?", "+", "{1,3}"]) for _ in range(rng.randint(1, 5)))
    return pattern if rng.random() < 0.7 else f"({pattern})|{random_regex(rng)}"


def token_texts(tokenizer) -> list[bytes]:
    """Each id's bytes (byte-level BPE: a completion's bytes are its tokens' bytes in a row)."""
    decode = {c: b for b, c in bytes_to_unicode().items()}
    texts = []
    for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        texts.append(b"" if token in tokenizer.all_special_tokens else bytes(decode[c] for c in token))
    return texts


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for chars from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


@pytest.fixture(scope="module")
def tokenizer(tied_model):
    return AutoTokenizer.from_pretrained(tied_model)


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_mask_never_allows_a_token_the_regex_forbids(tokenizer, backend):
    rng = random.Random(0)
    texts = token_texts(tokenizer)
    patterns = [random_regex(rng) for _ in range(12)]
    manager = StructuredOutputs(backend, tokenizer, 384, {EOS}, max_rows=len(patterns))
    rows = [SimpleNamespace(grammar=manager.state(check_constraint(StructuredOutputsParams(regex=p), backend)),
                            token_ids=[], text=b"", pattern=p) for p in patterns]
    assert manager.wait_for_compile() or all(row.grammar.ready for row in rows)
    generator = torch.Generator().manual_seed(0)
    steps = 0
    while rows and steps < 40:
        for row in rows:
            row.grammar.compiled.result()
        mask = manager.bitmask([(row, []) for row in rows])
        logits = apply_token_bitmask(torch.randn(len(rows), 384, generator=generator), mask)
        assert mask.rows == list(range(len(rows)))
        for row, row_logits in zip(rows, logits):
            allowed = (row_logits > float("-inf")).nonzero().flatten().tolist()
            assert allowed, f"nothing allowed after {row.text!r} for {row.pattern!r}"
            for token in allowed:
                if token == EOS:
                    assert regex.fullmatch(row.pattern, row.text.decode()), (row.pattern, row.text)
                    continue
                assert token < len(texts), f"id {token} is beyond the tokenizer"
                text = (row.text + texts[token]).decode(errors="replace")
                assert regex.fullmatch(row.pattern, text, partial=True), (row.pattern, text)
        sampled = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).flatten().tolist()
        for row, token in zip(rows, sampled):
            row.token_ids.append(token)
            row.text += texts[token] if token != EOS else b""
            row.grammar.accept(token)
        rows = [row for row in rows if row.token_ids[-1] != EOS and not row.grammar.is_stopped]
        steps += 1


def test_bitmask_applies_to_the_rows_it_names_only():
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = (1 << 5) - (1 << 31)  # bits 5 and 31 (the sign bit)
    bitmask[0, 2] = 1 << 1  # token 65
    masked = apply_token_bitmask(logits, TokenBitmask([1], bitmask))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert (masked[1] > float("-inf")).nonzero().flatten().tolist() == [5, 31, 65]
    assert torch.equal(masked[1, [5, 31, 65]], logits[1, [5, 31, 65]])


def test_padded_vocabulary_ids_are_never_allowed(tmp_path):
    model = make_checkpoint(str(tmp_path), vocab_size=512)
    tokenizer = AutoTokenizer.from_pretrained(model)
    known = len(tokenizer)
    assert known < 512
    manager = StructuredOutputs("guidance", tokenizer, 512, {EOS}, max_rows=1)
    row = SimpleNamespace(grammar=manager.state(check_constraint(StructuredOutputsParams(regex="(.|\n)*"),
                                                                 "guidance")))
    row.grammar.compiled.result()
    allowed = apply_token_bitmask(torch.zeros(1, 512), manager.bitmask([(row, [])]))[0] > float("-inf")
    assert allowed[:known].any() and not allowed[known:].any()


def test_a_waiting_request_whose_grammar_compiles_lets_the_others_start():
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                          enable_chunked_prefill=True, scheduling_policy="fcfs"))
    seqs = [Sequence(i, [1, 2, 3], 4, SamplingParams()) for i in range(3)]
    seqs[0].grammar = SimpleNamespace(ready=False)
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.schedule().seqs == seqs[1:]
    seqs[0].grammar.ready = True
    assert scheduler.schedule().seqs[-1] is seqs[0]


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    sentences = ["Hello, my name is", "The quick brown fox", "List all primes", "Paged attention stores",
                 "Continuous batching admits", "The cat sleeps"]
    return [tokenizer.encode(sentences[i % len(sentences)]) for i in range(n)]


@pytest.fixture(scope="module")
def llm(tied_model):
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256) as engine:
        yield engine


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_constrained_greedy_is_the_argmax_over_what_the_mask_allows(tied_model, tokenizer, backend):
    pattern = r"([a-z]{1,6} ){3,8}(cat|dog)\."
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    prompts = prompts_of(tokenizer, 3)
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256,
             structured_outputs_config={"backend": backend}) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(tied_model, dtype=torch.float32).eval()
    manager = StructuredOutputs(backend, tokenizer, 384, {EOS}, max_rows=1)
    agreed = 0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and regex.fullmatch(pattern, completion.text)
        row = SimpleNamespace(grammar=manager.state(check_constraint(params.structured_outputs, backend)),
                              token_ids=list(prompt))
        row.grammar.compiled.result()
        with torch.inference_mode():
            every = model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:].float()
        for token, logits in zip(completion.token_ids, every):
            masked = apply_token_bitmask(logits[None], manager.bitmask([(row, [])]))[0]
            assert token == masked.argmax().item()
            if masked[logits.argmax()] > float("-inf"):
                assert token == logits.argmax().item()
                agreed += 1
            row.token_ids.append(token)
            row.grammar.accept(token)
        assert row.grammar.is_stopped
    assert agreed > 0


def test_unconstrained_batch_mates_are_token_identical(llm, tokenizer):
    prompts = prompts_of(tokenizer, 4)
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)] * 2
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = SamplingParams(temperature=0.8, seed=1, max_tokens=24,
                                 structured_outputs=StructuredOutputsParams(regex=r"[a-z ]+\."))
    mixed = llm.generate(prompts + prompts, plain + [constrained] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(regex.fullmatch(r"[a-z ]+\.", o.outputs[0].text, partial=True) for o in mixed[4:])


def test_preemption_and_chunked_prefill_mid_grammar_keep_outputs_exact(tied_model, tokenizer):
    long_prompt = prompts_of(tokenizer, 1)[0] * 8
    prompts = prompts_of(tokenizer, 3) + [long_prompt]
    params = [SamplingParams(temperature=t, seed=5, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(regex=r"([a-z]{2,5} ){6,30}(fox|dog)"))
              for t in (0, 1.0, 0, 1.0)]
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=128) as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=8,
             max_model_len=128, max_num_batched_tokens=16) as tight:
        outputs = tight.generate(prompts, params, use_tqdm=False)
        stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_steps"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_one_schema_compiles_once(llm, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    other = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    before = llm.engine.structured.num_compiled, llm.engine.structured.num_cache_hits
    params = [SamplingParams(temperature=0, max_tokens=16, n=n, structured_outputs=StructuredOutputsParams(json=s))
              for s, n in [(schema, 1)] * 5 + [(other, 2), (dict(schema), 1)]]
    llm.generate(prompts_of(tokenizer, 7), params, use_tqdm=False)
    assert (llm.engine.structured.num_compiled - before[0], llm.engine.structured.num_cache_hits - before[1]) == (2, 6)
    llm.generate(prompts_of(tokenizer, 2), params[-2:], use_tqdm=False)
    assert llm.engine.structured.num_compiled - before[0] == 2


def test_choice_ends_with_stop_and_works_with_n_seeds_stop_strings_and_logprobs(llm, tokenizer):
    prompt = prompts_of(tokenizer, 1)[0]
    choices = ["red fox", "brown dog", "the cat"]
    params = SamplingParams(temperature=1.0, n=3, seed=11, logprobs=2, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    for completion in first.outputs:
        assert completion.text in choices and completion.finish_reason == "stop"
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(step[t].logprob > float("-inf") for step, t in zip(completion.logprobs, completion.token_ids))
    stopped = llm.generate([prompt], SamplingParams(temperature=0, stop=" ", structured_outputs=StructuredOutputsParams(
        regex=r"[a-z]+ [a-z]+ [a-z]+")), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " " and regex.fullmatch("[a-z]+", stopped.text)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("kwargs, message", [
    ({"json": {"type": "frobnicate"}}, "structured_outputs.json is not a valid JSON schema"),
    ({"regex": "[a-"}, "structured_outputs.regex is not a valid regular expression"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar is not a valid grammar"),
    ({"json": "{oops"}, "structured_outputs.json is not valid JSON"),
])
def test_bad_constraints_fail_at_submission_and_the_engine_still_serves(llm, tokenizer, kwargs, message):
    prompts = prompts_of(tokenizer, 2)
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = llm.generate(prompts[:1], good, use_tqdm=False)[0].outputs[0].token_ids
    steps = llm.stats()["num_steps"]
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, [good, bad], use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        llm.add_request(prompts[1], bad)
    assert llm.stats()["num_steps"] == steps and llm.is_finished()
    assert llm.generate(prompts[:1], good, use_tqdm=False)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("settings", [{"data_parallel_size": 2}, {"tensor_parallel_size": 2}], ids=["dp2", "tp2"])
def test_data_and_tensor_parallel_give_the_single_engines_tokens(llm, tied_model, tokenizer, settings):
    pattern = r"([a-z]{1,6} ){3,8}(cat|dog)\."
    params = [SamplingParams(temperature=t, seed=2, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(regex=pattern)) for t in (0, 1.0, 0, 1.0)]
    prompts = prompts_of(tokenizer, 4)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256,
             **settings) as parallel:
        outputs = [o.outputs[0] for o in parallel.generate(prompts, params, use_tqdm=False)]
    assert [c.token_ids for c in outputs] == expected
    assert all(c.finish_reason == "stop" and regex.fullmatch(pattern, c.text) for c in outputs)


def test_speculative_decoding_leaves_constrained_requests_and_batch_mates_exact(llm, tied_model, tokenizer):
    """With n-gram speculation on, unconstrained grounded requests verify drafts while constrained ones (no drafts:
    their mask is for one token) decode beside them: every output as without speculation."""
    passage = prompts_of(tokenizer, 1)[0]
    prompts = [passage * 4, passage * 3] + prompts_of(tokenizer, 2)
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=t, seed=7, max_tokens=32,
                       structured_outputs=StructuredOutputsParams(regex=r"([a-z]{2,5} ){3,20}(fox|dog)"))
        for t in (0, 1.0)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                 "disable_by_batch_size": 64}) as spec:
        outputs = spec.generate(prompts, params, use_tqdm=False)
        stats = spec.stats()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats["num_accepted_tokens"] > 0
    assert all(regex.fullmatch(r"([a-z]{2,5} ){3,20}(fox|dog)", o.outputs[0].text, partial=True) for o in outputs[2:])
    assert stats["num_free_blocks"] == stats["num_blocks"]
