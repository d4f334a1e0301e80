"""vLLM V1 scheduling end to end: chunked prefill, mixed steps, prefix hits mid-prefill, preemption mid-prefill
and mid-decode, priorities and aborts keep greedy output equal to transformers', token for token (float32)."""
import pytest
import torch
from checkpoints import hf_greedy
from test_engine_parity import GREEDY, MAX_TOKENS, PROMPT_LENGTHS, assert_all_blocks_free, random_prompts

from nanovllm import LLM, SamplingParams

CPU = dict(device="cpu", dtype="float32", max_model_len=1024)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def expected(tied_model, prompts) -> list[list[int]]:
    return hf_greedy(tied_model, prompts, MAX_TOKENS)


@pytest.mark.parametrize("budget", [7, 64, 255, 257])
def test_chunked_prefill_matches_transformers_at_awkward_budgets(tied_model, prompts, expected, budget):
    with LLM(tied_model, kvcache_block_size=16, max_num_batched_tokens=budget, **CPU) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == expected
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        stats = llm.stats()
        assert stats["num_chunked_steps"] > 0 and stats["num_mixed_steps"] > 0
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("model", ["llama_untied_model", "qwen2_model"])
def test_every_family_under_chunked_prefill(request, model, prompts):
    path = request.getfixturevalue(model)
    with LLM(path, kvcache_block_size=16, max_num_batched_tokens=100, **CPU) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == hf_greedy(path, prompts, MAX_TOKENS)


def test_prefill_first_mode_matches_transformers(tied_model, prompts, expected):
    with LLM(tied_model, enable_chunked_prefill=False, **CPU) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
        assert stats["num_chunked_steps"] == 0 and stats["num_mixed_steps"] == 0


def test_prefix_hits_on_a_prompt_still_being_prefilled(tied_model):
    shared = random_prompts([200], seed=11)[0]
    prompts = [shared + tail for tail in random_prompts([3, 40, 1], seed=12)] + [shared[:150]]
    expected = hf_greedy(tied_model, prompts, MAX_TOKENS)
    with LLM(tied_model, kvcache_block_size=16, max_num_batched_tokens=90, **CPU) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["num_cached_tokens"] >= 3 * 144, "the later prompts shared the first one's blocks"
        assert [o["token_ids"] for o in outputs] == expected
        assert_all_blocks_free(llm)


def test_preemption_mid_prefill_and_mid_decode_keeps_outputs_exact(tied_model, monkeypatch):
    prompts = random_prompts([40, 40, 40, 120], seed=4)
    expected = hf_greedy(tied_model, prompts, 48)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(tied_model, kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=256, max_num_batched_tokens=16,
             device="cpu", dtype="float32") as llm:
        scheduler, seen = llm.engine.scheduler, set()
        preempt = scheduler.preempt

        def recording_preempt(seq):
            seen.add("prefill" if seq.num_computed_tokens < seq.num_prompt_tokens else "decode")
            preempt(seq)

        monkeypatch.setattr(scheduler, "preempt", recording_preempt)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert seen == {"prefill", "decode"}
        assert [o["token_ids"] for o in outputs] == expected
        assert_all_blocks_free(llm)


def test_priorities_order_the_work_and_keep_outputs_exact(tied_model, prompts, expected):
    priority = [5, 0, 9, 1, 3, 3, 2, 8, 7, 4]
    with LLM(tied_model, scheduling_policy="priority", max_num_seqs=2, **CPU) as llm:
        ids = [llm.add_request(p, GREEDY, priority=pr) for p, pr in zip(prompts, priority)]
        finished = []
        while not llm.is_finished():
            finished += [out.request_id for out in llm.step() if out.finished]
        assert [ids.index(i) for i in finished[:2]] == [1, 3], "the two most urgent requests ran first"
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=priority)
        assert [o["token_ids"] for o in outputs] == expected
    with LLM(tied_model, max_num_seqs=2, **CPU) as llm:  # first-come-first-served ignores priorities, as vLLM
        ids = [llm.add_request(p, GREEDY, priority=pr) for p, pr in zip(prompts, priority)]
        finished = []
        while not llm.is_finished():
            finished += [out.request_id for out in llm.step() if out.finished]
        assert [ids.index(i) for i in finished[:2]] == [0, 1]


def test_abort_request_frees_its_blocks_and_the_rest_finish_exactly(tied_model, prompts, expected):
    with LLM(tied_model, kvcache_block_size=16, max_num_batched_tokens=64, **CPU) as llm:
        ids = [llm.add_request(p, GREEDY) for p in prompts]
        llm.abort_request(ids[9])  # still waiting
        final = {}
        while not llm.is_finished():
            for out in llm.step():
                if out.request_id == ids[3] and len(out["token_ids"]) == 5:
                    llm.abort_request(ids[3])  # running, mid-decode
                final[out.request_id] = out.outputs[0]
        assert ids[9] not in final
        assert final[ids[3]].token_ids == expected[3][:5]
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
        for i in (0, 1, 2, 4, 5, 6, 7, 8):
            assert (final[ids[i]].finish_reason, final[ids[i]].token_ids) == ("length", expected[i])
        llm.abort_request(ids[0])  # finished already: nothing happens
        assert_all_blocks_free(llm)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_chunked_prefill_and_mixed_steps_on_the_gpu(gpu_model, name):
    """float32 on the GPU: chunked prefill at an awkward budget, with mixed steps and CUDA-graph decode steps in
    between, token-exact against transformers on the same GPU."""
    from cuda_backends import require_backend

    require_backend(name, torch.float32, 16, 64)
    prompts = random_prompts([1, 7, 100, 255, 300], seed=31)
    expected = hf_greedy(gpu_model, prompts, MAX_TOKENS, device="cuda")
    for chunked in (True, False):
        with LLM(gpu_model, dtype="float32", attention_backend=name, kvcache_block_size=16, max_model_len=512,
                 max_num_batched_tokens=57 if chunked else 512, enable_chunked_prefill=chunked) as llm:
            assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
            assert (llm.stats()["num_mixed_steps"] > 0) == chunked
            assert_all_blocks_free(llm)


def test_a_prompt_s_logits_are_bitwise_the_same_however_it_was_prefilled(tied_model):
    """A prompt's last logits, whole in one step, chunked (7 or 64 tokens a step), after a prefix-cache hit of 48 or
    96 of its tokens (the rest 4 or 52 rows), or beside other prompts: every CPU query row attends as its token's
    decode, so they are the same bits (through SDPA, a row's result changed with the rows beside it and greedy tokens
    of a real model changed after a cache hit)."""
    prompt = random_prompts([100], seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)

    def last_logprobs(llm: LLM, prompts: list[list[int]]) -> dict:
        return llm.generate(prompts, params, use_tqdm=False)[-1].outputs[0].logprobs[0]

    with LLM(tied_model, kvcache_block_size=16, enable_prefix_caching=False, **CPU) as llm:
        whole = last_logprobs(llm, [prompt])
    for budget in (7, 64):
        with LLM(tied_model, kvcache_block_size=16, enable_prefix_caching=False, max_num_batched_tokens=budget,
                 **CPU) as llm:
            assert last_logprobs(llm, [prompt]) == whole, budget
    with LLM(tied_model, kvcache_block_size=16, **CPU) as llm:
        for cached in (48, 96):
            llm.generate([prompt[:cached] + [1]], params, use_tqdm=False)  # leaves the prefix's blocks cached
            before = llm.stats()["num_cached_tokens"]
            assert last_logprobs(llm, [prompt]) == whole, cached
            assert llm.stats()["num_cached_tokens"] - before == cached
        assert last_logprobs(llm, random_prompts([30, 70], seed=12) + [prompt]) == whole
