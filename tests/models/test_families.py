"""Each family greedy token-exact against transformers in float32 on CPU (tiny random checkpoints, a 300-token
tokenizer over a 384-entry vocabulary): one batch of mixed lengths, prompts longer than the sliding windows (24 and 40
tokens) run in chunks of a 64-token budget, then the same prompts again served from the prefix cache."""
import random

import pytest
from checkpoints import hf_greedy, make_family_checkpoint

from nanovllm import LLM, SamplingParams

MAX_TOKENS = 24
PROMPTS = [[random.Random(n).randrange(384) for _ in range(n)] for n in (1, 7, 33, 100)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SETTINGS = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, max_num_batched_tokens=64)

# (family in FAMILY_CONFIGS, tied embeddings, config.json entries written as hub checkpoints have them)
CASES = [
    ("mistral", False, None),
    ("mistral_full", True, {"rope_theta": 1e6}),
    ("gemma", True, None),
    ("gemma2", True, None),
    ("gemma3", True, {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
                      "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("phi3", False, None),
    ("olmo2", False, None),
    ("granite", True, None),
    ("gpt_neox", False, None),
    ("gpt_neox_sequential", True, None),
    ("stablelm", False, None),
    ("stablelm_parallel", True, None),
    ("stablelm_qk_norm", False, None),
    ("qwen2_window", True, None),
]


def generate_twice(path: str, prompts: list[list[int]], **settings) -> tuple[list, list, dict]:
    with LLM(path, **{**SETTINGS, **settings}) as llm:
        first = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        again = [o["token_ids"] for o in llm.generate(prompts[::-1], GREEDY, use_tqdm=False)][::-1]
        return first, again, llm.stats()


@pytest.mark.parametrize("family, tied, hub", CASES, ids=[case[0] for case in CASES])
def test_family_matches_transformers(tmp_path, family, tied, hub):
    path = make_family_checkpoint(str(tmp_path / family), family, tie_word_embeddings=tied, seed=len(family),
                                  hub_config=hub)
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    first, again, stats = generate_twice(path, PROMPTS)
    assert first == expected
    assert again == expected
    assert stats["num_cached_tokens"] > 0 and stats["num_chunked_steps"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_a_long_mistral_sequence_holds_about_a_window_of_blocks(tmp_path):
    """Window 24, blocks of 16: a 100-token prompt and 24 more tokens run in steps of at most 64 tokens hold at most
    the blocks of one step's windows, (24 + 63) / 16 rounded up, plus the block kept for hashing; the whole sequence
    would take 8."""
    path = make_family_checkpoint(str(tmp_path / "mistral"), "mistral")
    prompt = PROMPTS[-1]
    expected = hf_greedy(path, [prompt], MAX_TOKENS)
    with LLM(path, **SETTINGS) as llm:
        assert [o["token_ids"] for o in llm.generate([prompt], GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["num_released_blocks"] > 0
    assert stats["peak_used_blocks"] <= -(-(24 + 63) // 16) + 1 < -(-(100 + MAX_TOKENS) // 16)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_alternating_windows_release_nothing(tmp_path):
    """Gemma 2 mixes global layers with local ones: every block stays until the sequence ends."""
    path = make_family_checkpoint(str(tmp_path / "gemma2"), "gemma2", tie_word_embeddings=True)
    with LLM(path, **SETTINGS) as llm:
        llm.generate(PROMPTS[-1:], GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert stats["num_released_blocks"] == 0 and stats["peak_used_blocks"] == -(-(100 + MAX_TOKENS - 1) // 16)


def test_gemma2_tensor_parallel_2_matches_transformers(tmp_path):
    """Two gloo ranks: GeGLU and the vocabulary split, soft-capped scores and logits, alternating windows."""
    path = make_family_checkpoint(str(tmp_path / "gemma2"), "gemma2", tie_word_embeddings=True)
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    with LLM(path, tensor_parallel_size=2, **SETTINGS) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_olmo2_tensor_parallel_2_matches_transformers(tmp_path):
    """OLMo 2 normalizes q and k over all heads: with the heads split over two ranks, the sum of squares is
    all-reduced."""
    path = make_family_checkpoint(str(tmp_path / "olmo2"), "olmo2")
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    with LLM(path, tensor_parallel_size=2, **SETTINGS) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_mistral_preempted_with_released_blocks_stays_exact(tmp_path):
    """Four 100-token prompts in a 14-block cache (each needs 8 blocks unreleased, at most 6 windowed): sequences
    are preempted, their remaining blocks freed, and recomputed; the tokens stay transformers'."""
    path = make_family_checkpoint(str(tmp_path / "mistral"), "mistral")
    prompts = [[random.Random(seed).randrange(384) for _ in range(100)] for seed in range(4)]
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    with LLM(path, **{**SETTINGS, "num_kvcache_blocks": 14, "max_model_len": 128}) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_released_blocks"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
