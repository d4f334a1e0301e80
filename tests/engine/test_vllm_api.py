"""vLLM's offline API as its users write it, and outputs that reach their caller whoever drives the engine:
interleaved streams, generate() inside a stream, several threads, one request's failure."""
import inspect
import logging
import threading

import pytest
from checkpoints import hf_greedy
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.engine.request import Completion

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 45)), [11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tied_model):
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256,
             max_num_batched_tokens=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def expected(tied_model):
    return hf_greedy(tied_model, PROMPTS, GREEDY.max_tokens)


def test_the_api_is_defined_on_the_class():
    """help(LLM), an IDE and inspect see every method with its signature and docstring: none is forwarded by
    __getattr__."""
    assert not hasattr(LLM, "__getattr__")
    api = ["generate", "chat", "chat_prompt", "stream", "add_request", "step", "abort_request", "is_finished", "stats",
           "get_metrics", "get_tokenizer", "exit"]
    assert all(inspect.isfunction(getattr(LLM, name)) and getattr(LLM, name).__doc__ for name in api)
    assert list(inspect.signature(LLM.generate).parameters) == ["self", "prompts", "sampling_params", "use_tqdm",
                                                                 "priority", "lora_request"]
    assert "def generate" in inspect.getsource(LLM)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert llm.is_finished() and stats["num_free_blocks"] == stats["num_blocks"]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def collect(stream) -> dict[str, list[int]]:
    tokens, finished = {}, set()
    for out in stream:
        tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        if out.outputs[0].finish_reason:
            finished.add(out.request_id)
    assert finished == set(tokens)
    return tokens


def in_order(tokens: dict[str, list[int]]) -> list[list[int]]:
    return [tokens[request_id] for request_id in sorted(tokens, key=int)]


def test_vllm_prompt_forms_defaults_and_tokenizer(llm, tied_model):
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("Hello") == AutoTokenizer.from_pretrained(tied_model).encode("Hello")
    text = "Hello, my name is"
    ids = tokenizer.encode(text)
    single = llm.generate(text, GREEDY, use_tqdm=False)
    forms = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, ids], GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt == text and forms[0].prompt == text and forms[1].prompt is None
    assert token_ids(forms) == token_ids(single) * 3
    default = llm.generate(text, use_tqdm=False)[0]  # SamplingParams(): temperature 1, at most 16 tokens
    assert 1 <= len(default.outputs[0].token_ids) <= 16 and default.finished
    assert all(isinstance(o.request_id, str) for o in [*single, *forms, default])
    assert [int(o.request_id) for o in forms] == [int(forms[0].request_id) + i for i in range(3)]
    assert_all_blocks_free(llm)


def test_abort_takes_one_id_or_a_list(llm):
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    llm.abort_request(ids[0])
    llm.abort_request(ids[1:3])
    finished = {}
    while not llm.is_finished():
        finished.update((o.request_id, o) for o in llm.step())
    assert list(finished) == [ids[3]]
    assert_all_blocks_free(llm)


def test_logprobs_order_whole_vocabulary_and_detokenize_off(tied_model):
    with LLM(tied_model, device="cpu", dtype="float32", max_model_len=128, max_logprobs=-1) as engine:
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3)
        for step in engine.generate(PROMPTS[:2], params, use_tqdm=False)[1].outputs[0].logprobs:
            first, *rest = step.values()
            assert [lp.rank for lp in rest] == sorted(lp.rank for lp in rest)
            assert first.rank >= 1 and len(step) in (4, 5)
        whole = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2, logprobs=-1),
                                use_tqdm=False)[0].outputs[0]
        assert all(len(step) == 384 for step in whole.logprobs)
        raw = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2, logprobs=1, detokenize=False),
                              use_tqdm=False)[0].outputs[0]
        assert raw.token_ids == whole.token_ids and raw.text == ""
        assert all(lp.decoded_token is None for step in raw.logprobs for lp in step.values())
    with LLM(tied_model, device="cpu", dtype="float32", max_model_len=128) as engine, \
            pytest.raises(ValueError, match="more than the engine's max_logprobs=20"):
        engine.generate(PROMPTS[:1], SamplingParams(logprobs=-1), use_tqdm=False)


def test_metrics_cached_tokens_and_max_tokens_none(llm):
    shared = list(range(100, 140))
    first, second = llm.generate([shared + [1], shared + [2]], GREEDY, use_tqdm=False)
    again = llm.generate([shared + [3]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # two whole 16-token blocks of the shared prefix
    m = again.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    to_the_end = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    assert to_the_end.finish_reason == "length" and len(to_the_end.token_ids) == 256 - len(PROMPTS[0])
    assert_all_blocks_free(llm)


def test_allowed_token_ids_and_bad_words(llm, expected):
    allowed = [5, 17, 42, 99]
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=20, allowed_token_ids=allowed),
                           use_tqdm=False)
    assert {t for ids in token_ids(sampled) for t in ids} <= set(allowed)
    tokenizer = llm.get_tokenizer()
    banned = next(t for t in expected[2] if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  bad_words=[tokenizer.decode([banned])]), use_tqdm=False)[0]
    assert banned not in out.outputs[0].token_ids
    cut = expected[2].index(banned)
    assert out.outputs[0].token_ids[:cut] == expected[2][:cut]


def test_interleaved_streams_and_generate_inside_a_stream_get_everything(llm, expected):
    a, b = llm.stream(PROMPTS[:2], GREEDY), llm.stream(PROMPTS[2:], GREEDY)
    first = next(a)  # a steps once; then b is read to its end (stepping a's requests too)
    tokens_b = collect(b)
    tokens_a = collect(a)
    tokens_a[first.request_id] = first.outputs[0].token_ids + tokens_a.get(first.request_id, [])
    assert in_order(tokens_a) + in_order(tokens_b) == expected

    inner = None
    tokens = {}
    for out in llm.stream(PROMPTS[:2], GREEDY):
        tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        if inner is None:
            inner = token_ids(llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False))
    assert in_order(tokens) == expected[:2] and inner == expected[2:]
    assert_all_blocks_free(llm)


def test_threads_share_batches_and_each_gets_its_own_outputs(llm, expected):
    results, errors = {}, []
    start = threading.Barrier(4)

    def call(i: int) -> None:
        try:
            prompts = [PROMPTS[(i + j) % 4] for j in range(3)]
            start.wait()
            results[i] = (prompts, token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)))
        except BaseException as e:
            errors.append(e)

    steps = llm.stats()["num_steps"]
    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for prompts, outputs in results.values():
        assert outputs == [expected[PROMPTS.index(p)] for p in prompts]
    # one after another, the four calls would take at least 4 x 12 steps (12 tokens each)
    assert llm.stats()["num_steps"] - steps < 4 * GREEDY.max_tokens, "the threads' requests did not share steps"
    assert_all_blocks_free(llm)


def test_a_request_whose_output_fails_is_aborted_alone(llm, expected, monkeypatch, caplog):
    update = Completion.update
    victim = []

    def failing(self, logprobs, ending, **kwargs):
        if self.seq.token_ids[:len(PROMPTS[1])] == PROMPTS[1] and len(self.seq.completion_token_ids) == 3:
            victim.append(self.seq.seq_id)
            raise TypeError("boom")
        return update(self, logprobs, ending, **kwargs)

    monkeypatch.setattr(Completion, "update", failing)
    with caplog.at_level(logging.ERROR, logger="nanovllm"):
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert victim and "processing its output failed" in caplog.text
    assert outputs[1].outputs[0].finish_reason == "abort"
    assert [token_ids(outputs)[i] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert_all_blocks_free(llm)


def test_llm_without_a_model_says_what_to_pass():
    with pytest.raises(ValueError, match=r"LLM needs a model: a Hugging Face model directory or a .gguf file"):
        LLM()


def test_max_model_len_defaults_to_the_models_within_the_kv_cache(tied_model, caplog):
    with LLM(tied_model, device="cpu", dtype="float32") as engine:
        assert engine.max_model_len == 1024  # the checkpoint's max_position_embeddings
    with caplog.at_level(logging.INFO, logger="nanovllm"), \
            LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=40) as engine:
        assert engine.max_model_len == 640
    assert "max_model_len lowered from the model's 1024 to 640" in caplog.text
    with pytest.raises(ValueError, match="the KV cache holds 40 blocks"):
        LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=1024)


def test_prompt_logprobs_equal_transformers_across_prefill_chunks(tied_model, llm):
    """A 45-token prompt prefilled in 64-token budgets shared with another request (so in chunks), and not served
    from the prefix cache: every prompt token's log-probability is log_softmax of transformers' logits."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = list(range(50, 95))
    llm.generate([prompt], GREEDY, use_tqdm=False)  # its blocks are now in the prefix cache
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    other, out = llm.generate([list(range(200, 240)), prompt], [GREEDY, params], use_tqdm=False)  # 24 + 21
    assert other.prompt_logprobs is None and out.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    model = AutoModelForCausalLM.from_pretrained(tied_model, dtype=torch.float32)
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for position in range(1, len(prompt)):
        scores, token = out.prompt_logprobs[position], prompt[position]
        top = reference[position - 1].topk(2).indices.tolist()
        assert list(scores) == list(dict.fromkeys([token, *top]))  # the prompt's token first, then by rank
        for token_id, logprob in scores.items():
            assert logprob.logprob == pytest.approx(reference[position - 1, token_id].item(), abs=1e-4)
    assert_all_blocks_free(llm)
