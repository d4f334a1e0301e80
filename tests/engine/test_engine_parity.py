"""Greedy output of the engine equals transformers' greedy output, token for token, in float32."""
import random

import pytest
from checkpoints import hf_greedy

from nanovllm import LLM, SamplingParams

MAX_TOKENS = 32
PROMPT_LENGTHS = [1, 2, 7, 16, 33, 100, 255, 256, 300, 600]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def random_prompts(lengths: list[int], vocab_size: int = 384, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


# Every checkpoint fixture (see conftest.py), and one per family for the scheduling paths.
MODELS = ["tied_model", "untied_model", "llama_tied_model", "llama_untied_model", "qwen2_model"]
FAMILIES = ["tied_model", "llama_tied_model", "qwen2_model"]


@pytest.fixture(scope="module")
def references(prompts):
    """transformers' greedy continuations of `prompts` for a checkpoint path, computed once per path."""
    computed: dict[str, list[list[int]]] = {}

    def reference(path: str) -> list[list[int]]:
        if path not in computed:
            computed[path] = hf_greedy(path, prompts, MAX_TOKENS)
        return computed[path]

    return reference


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("block_size", [256, 16])
@pytest.mark.parametrize("model", MODELS)
def test_greedy_matches_transformers(request, model, block_size, prompts, references):
    path = request.getfixturevalue(model)
    with LLM(path, kvcache_block_size=block_size, max_model_len=1024, device="cpu", dtype="float32") as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == references(path)
        assert all(o["text"] == llm.tokenizer.decode(o["token_ids"], skip_special_tokens=True) for o in outputs)
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("model", FAMILIES)
def test_prefix_cache_hits_and_keeps_tokens(request, model):
    path = request.getfixturevalue(model)
    shared = random_prompts([200], seed=1)[0]
    tails = random_prompts([1, 5, 40, 90], seed=2)
    prompts = [shared + tail for tail in tails] + [shared[:48]]
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    with LLM(path, kvcache_block_size=16, max_model_len=1024, device="cpu", dtype="float32") as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        cached_after_first = llm.stats()["num_cached_tokens"]
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["num_cached_tokens"] > cached_after_first > 0
        assert [o["token_ids"] for o in first] == expected
        assert [o["token_ids"] for o in second] == expected
        assert_all_blocks_free(llm)


def test_whole_prompt_cache_hit_still_computes_last_token(tied_model):
    prompt = random_prompts([64], seed=3)[0]  # exactly 4 blocks of 16, the CPU's default block size
    expected = hf_greedy(tied_model, [prompt], MAX_TOKENS)
    with LLM(tied_model, max_model_len=1024, device="cpu", dtype="float32") as llm:
        for _ in range(2):
            assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == expected[0]
        assert llm.stats()["num_cached_tokens"] == 48
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("model", FAMILIES)
def test_preemption_keeps_outputs_exact(request, model):
    path = request.getfixturevalue(model)
    prompts = random_prompts([30, 50, 20, 45, 60, 10], seed=4)
    expected = hf_greedy(path, prompts, 48)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=256, device="cpu",
             dtype="float32") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
        assert [o["token_ids"] for o in outputs] == expected
        assert_all_blocks_free(llm)


def test_mixed_temperatures_in_one_batch(tied_model, prompts, references):
    """Sampled requests share the batch with greedy ones; the greedy ones stay exact."""
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 0.8, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    with LLM(tied_model, max_model_len=1024, device="cpu", dtype="float32") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outputs):
        assert len(out["token_ids"]) == MAX_TOKENS
        assert all(0 <= t < 384 for t in out["token_ids"])
        if i % 2 == 0:
            assert out["token_ids"] == references(tied_model)[i]


def test_stops_at_eos_and_at_max_model_len(tied_model, tmp_path):
    import json
    import shutil

    prompt = random_prompts([20], seed=5)[0]
    greedy = hf_greedy(tied_model, [prompt], MAX_TOKENS)[0]
    stop_at = next(i for i in range(3, MAX_TOKENS) if greedy[i] not in greedy[:i])
    path = shutil.copytree(tied_model, tmp_path / "eos-model")
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = greedy[stop_at]
    (path / "config.json").write_text(json.dumps(config))
    with LLM(str(path), max_model_len=64, device="cpu", dtype="float32") as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
        assert out["token_ids"] == greedy[:stop_at + 1]
        long_prompt = random_prompts([60], seed=6)[0]
        out = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)[0]
        assert len(out["token_ids"]) == 64 - 60
        assert_all_blocks_free(llm)


def test_text_prompts_round_trip(tied_model):
    with LLM(tied_model, max_model_len=1024, device="cpu", dtype="float32") as llm:
        token_ids = llm.tokenizer.encode("Hello, my name is")
        by_text = llm.generate(["Hello, my name is"], GREEDY, use_tqdm=False)[0]
        by_ids = llm.generate([token_ids], GREEDY, use_tqdm=False)[0]
    assert by_text.outputs == by_ids.outputs and by_text.prompt_token_ids == by_ids.prompt_token_ids == token_ids
    assert (by_text.prompt, by_ids.prompt) == ("Hello, my name is", None)
    assert by_text["token_ids"] == hf_greedy(tied_model, [token_ids], MAX_TOKENS)[0]
