"""The vLLM-style sampling and output API through the whole engine (CPU, float32): truncation that equals greedy,
seeds independent of the batch, penalties, min_tokens and logprobs against transformers, stop strings and stop
tokens, n > 1 over a shared prefix, chat, streaming, and bad values rejected before any work."""
import shutil

import pytest
import torch
from checkpoints import hf_greedy
from test_engine_parity import assert_all_blocks_free, random_prompts
from transformers import AutoModelForCausalLM

from nanovllm import LLM, RequestOutput, SamplingParams

MAX_TOKENS = 24
CPU = dict(device="cpu", dtype="float32", max_model_len=512, kvcache_block_size=16)


@pytest.fixture(scope="module")
def llm(tied_model):
    with LLM(tied_model, **CPU) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([5, 40, 100], seed=21)


@pytest.fixture(scope="module")
def greedy(tied_model, prompts) -> list[list[int]]:
    return hf_greedy(tied_model, prompts, MAX_TOKENS)


@torch.inference_mode()
def hf_generate(path: str, prompt: list[int], **kwargs) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0), dict(temperature=0, top_k=7)])
def test_truncation_to_one_token_is_greedy(llm, prompts, greedy, params):
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == greedy


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0]["token_ids"]
    crowd = random_prompts([3, 70, 9, 33], seed=22)
    in_batch = llm.generate(crowd[:2] + [prompts[1]] + crowd[2:], [noise, noise, seeded, noise, noise],
                            use_tqdm=False)[2]["token_ids"]
    assert alone == in_batch == llm.generate([prompts[1]], seeded, use_tqdm=False)[0]["token_ids"]
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert llm.generate([prompts[1]], other_seed, use_tqdm=False)[0]["token_ids"] != alone


def test_repetition_penalty_and_min_tokens_equal_transformers_generate(llm, tied_model, prompts, greedy):
    params = SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = llm.generate([prompts[2]], params, use_tqdm=False)[0]["token_ids"]
    assert ours == hf_generate(tied_model, prompts[2], repetition_penalty=1.8, max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS)
    assert ours != greedy[2]
    stop = greedy[0][2]  # greedy would stop on its third token
    params = SamplingParams(temperature=0, stop_token_ids=[stop], min_tokens=6, max_tokens=MAX_TOKENS)
    out = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_generate(tied_model, prompts[0], eos_token_id=[0, stop], min_new_tokens=6,
                                        max_new_tokens=MAX_TOKENS)
    assert stop not in out.token_ids[:6]


def test_logprobs_equal_log_softmax_of_transformers_logits(llm, tied_model, prompts, greedy):
    params = SamplingParams(temperature=0, logprobs=5, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompts[1]], params, use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tied_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompts[1] + out.token_ids])).logits[0]
    reference = logits[len(prompts[1]) - 1:-1].log_softmax(-1)
    assert len(out.logprobs) == 8
    for step, (token, ranked) in enumerate(zip(out.token_ids, out.logprobs)):
        top = reference[step].topk(5)
        assert set(ranked) == set(top.indices.tolist()) | {token}
        assert ranked[token].rank == 1 and token == top.indices[0]
        for token_id, lp in ranked.items():
            assert lp.logprob == pytest.approx(reference[step, token_id].item(), abs=1e-4)
            text = llm.tokenizer.decode([token_id])  # a split character's bytes: completed by the tokens before
            assert lp.decoded_token == text if not text.endswith("\ufffd") else not lp.decoded_token.endswith("\ufffd")
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs)))


def test_stop_strings_across_tokens_and_stop_tokens(llm, prompts, greedy):
    tokenizer = llm.tokenizer
    pieces = [tokenizer.decode([t]) for t in greedy[1]]
    k = next(i for i in range(3, MAX_TOKENS - 1)
             if pieces[i] and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1])
    full = tokenizer.decode(greedy[1])
    before = len(tokenizer.decode(greedy[1][:k + 1]))
    stop = full[before - 1:before + 1]  # the last character of token k and the first of token k + 1
    first = full.find(stop)
    base = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([prompts[1]], SamplingParams(stop=["never appears!", stop], **base), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (full[:first], "stop", stop)
    assert tokenizer.decode(completion.token_ids).startswith(full[:first + len(stop)])
    assert len(tokenizer.decode(completion.token_ids[:-1])) < first + len(stop), "no token after the stop string"
    kept = llm.generate([prompts[1]], SamplingParams(stop=stop, include_stop_str_in_output=True, **base),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[:first + len(stop)]
    token = greedy[1][5]
    by_token = llm.generate([prompts[1]], SamplingParams(stop_token_ids=[token], **base), use_tqdm=False)[0].outputs[0]
    end = greedy[1].index(token) + 1
    assert (by_token.token_ids, by_token.finish_reason, by_token.stop_reason) == (greedy[1][:end], "stop", token)
    assert by_token.text == tokenizer.decode(greedy[1][:end - 1], skip_special_tokens=True)
    assert_all_blocks_free(llm)


def test_n_samples_share_the_prompt_computed_once(tied_model):
    prompt = random_prompts([200], seed=23)[0]
    with LLM(tied_model, **CPU) as llm:
        out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)[0]
        assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
        assert llm.stats()["num_cached_tokens"] == 3 * 192, "three samples hit the first one's 12 full blocks"
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "different seeds, different samples"
        again = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True), use_tqdm=False)[0]
        assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
        greedy = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)[0]
        assert [c.token_ids for c in greedy.outputs] == hf_greedy(tied_model, [prompt], 8) * 2
        assert_all_blocks_free(llm)


def test_chat_applies_the_template(tied_model, tmp_path):
    path = shutil.copytree(tied_model, tmp_path / "chat-model")
    template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    with LLM(str(path), **CPU) as llm:
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat([{"role": "user", "content": "hi"}], SamplingParams())
        llm.tokenizer.chat_template = template
        conversations = [[{"role": "user", "content": "Hello, my name is Ada"}],
                         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List all primes"}]]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outputs = llm.chat(conversations, params, use_tqdm=False)
        text = "<|endoftext|>user: Hello, my name is Ada\nassistant:"
        assert outputs[0].prompt == text
        assert outputs[0].prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
        assert [o["token_ids"] for o in outputs] == hf_greedy(str(path), [o.prompt_token_ids for o in outputs], 8)
        assert llm.chat(conversations[0], params, use_tqdm=False)[0].outputs == outputs[0].outputs
        with pytest.raises(ValueError, match="messages must be a conversation"):
            llm.chat([{"content": "no role"}], params)
        with pytest.raises(ValueError, match=r"got 'Hello'; to send text as it is, use generate\(\)"):
            llm.chat("Hello", params)
        with pytest.raises(ValueError, match=r"got \{'role': 'user', 'content': 'Hello'\}"):
            llm.chat({"role": "user", "content": "Hello"}, params)


def test_stream_deltas_add_up_to_the_generated_outputs(llm, prompts):
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
              SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=MAX_TOKENS // 2, ignore_eos=True)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    text, tokens, logprobs, finish, order = {}, {}, {}, {}, []
    for out in llm.stream(prompts, params):
        assert isinstance(out, RequestOutput) and out.outputs
        for c in out.outputs:
            key = (out.request_id, c.index)
            assert key not in finish, "nothing follows a completion's final delta"
            assert not c.text.endswith("\ufffd") or c.finish_reason, "no delta ends inside a character"
            text[key] = text.get(key, "") + c.text
            tokens[key] = tokens.get(key, []) + c.token_ids
            logprobs[key] = logprobs.get(key, []) + (c.logprobs or [])
            if c.finish_reason:
                finish[key] = c.finish_reason
        order.append(out.request_id)
    first = min(map(int, order))
    for i, request in enumerate(expected):
        for c in request.outputs:
            key = (str(first + i), c.index)
            assert (text[key], tokens[key], finish[key]) == (c.text, c.token_ids, c.finish_reason)
            assert logprobs[key] == (c.logprobs or [])
    assert_all_blocks_free(llm)


def test_leaving_a_stream_early_aborts_its_requests(llm, prompts, greedy):
    stream = llm.stream(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.is_finished()
    assert_all_blocks_free(llm)
    assert llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)[0]["token_ids"] == greedy[0]


@pytest.mark.parametrize("params, message", [
    (dict(stop_token_ids=[384]), "stop_token_ids has token id 384 outside the vocabulary"),
    (dict(logprobs=21), "logprobs=21 asks for 21 log-probabilities per token, more than the engine.s max_logprobs=20"),
])
def test_params_the_model_cannot_serve_are_rejected_before_any_work(llm, prompts, greedy, params, message):
    good = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompts[0], prompts[1]], [good, SamplingParams(**params)], use_tqdm=False)
    assert llm.is_finished() and llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
    assert llm.generate([prompts[0]], good, use_tqdm=False)[0]["token_ids"] == greedy[0]


def test_flat_logprobs_read_as_the_lists(llm, prompts):
    """`flat_logprobs=True` (vLLM's): the same logprobs and prompt logprobs, as `FlatLogprobs` that read position by
    position as the lists of dicts (the prompt's first position, None there, an empty dict here)."""
    from nanovllm.logprobs import FlatLogprobs

    params = dict(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    listed = llm.generate([prompts[0]], SamplingParams(**params), use_tqdm=False)[0]
    flat = llm.generate([prompts[0]], SamplingParams(**params, flat_logprobs=True), use_tqdm=False)[0]
    assert isinstance(flat.outputs[0].logprobs, FlatLogprobs) and isinstance(flat.prompt_logprobs, FlatLogprobs)
    assert list(flat.outputs[0].logprobs) == listed.outputs[0].logprobs
    assert flat.prompt_logprobs[0] == {} and list(flat.prompt_logprobs[1:]) == listed.prompt_logprobs[1:]
    assert len(flat.prompt_logprobs) == len(listed.prompt_logprobs) and flat.outputs[0].token_ids == \
        listed.outputs[0].token_ids
