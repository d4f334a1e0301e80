"""Speculative decoding with n-gram prompt lookup: the same output as without it (greedy: transformers' output, token
for token; seeded sampling: the same tokens), whatever the batch, the cache or preemption, and every block freed."""
import pytest
from checkpoints import hf_greedy
from test_engine_parity import assert_all_blocks_free, random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.execution.cuda_graph import VerifyPrice
from nanovllm.execution.model_runner import ModelRunner

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64}
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def grounded_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a passage, as an edit of a given text does, so that lookup finds proposals."""
    return [passage * 3 + passage[:len(passage) // 2] for passage in random_prompts(lengths, seed=seed)]


def spec_llm(path: str, **settings) -> LLM:
    settings = dict(dict(kvcache_block_size=16, max_model_len=1024, device="cpu", dtype="float32"), **settings)
    return LLM(path, speculative_config=settings.pop("speculative_config", NGRAM), **settings)


def assert_drafts_accepted(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["num_draft_tokens"] > stats["num_accepted_tokens"]
    assert stats["spec_acceptance_rate"] == stats["num_accepted_tokens"] / stats["num_draft_tokens"]
    assert stats["spec_mean_accepted_length"] == 1 + stats["num_accepted_tokens"] / stats["num_spec_rows"]


def test_greedy_equals_transformers_with_mixed_lengths_and_prefix_cache(tied_model):
    prompts = grounded_prompts([1, 3, 7, 12, 30, 70]) + random_prompts([5, 40], seed=9)
    expected = hf_greedy(tied_model, prompts, MAX_TOKENS)
    with spec_llm(tied_model) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        cached = llm.stats()["num_cached_tokens"]
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["num_cached_tokens"] > cached
        assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second] == expected
        assert_drafts_accepted(llm)
        assert_all_blocks_free(llm)


def test_cached_blocks_hold_accepted_tokens_only(tied_model):
    """A block filled by accepted drafts serves a later prompt that continues them; one with rejected drafts' K/V
    does not, so the later prompt's output stays exact."""
    prompt = grounded_prompts([10], seed=3)[0]
    with spec_llm(tied_model) as llm:
        completion = llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
        assert_drafts_accepted(llm)
        follow_up = prompt + completion + [5, 6]
        cached = llm.stats()["num_cached_tokens"]
        out = llm.generate([follow_up], GREEDY, use_tqdm=False)[0]
        assert llm.stats()["num_cached_tokens"] - cached == (len(prompt) + len(completion) - 1) // 16 * 16
        assert out["token_ids"] == hf_greedy(tied_model, [follow_up], MAX_TOKENS)[0]
        assert_all_blocks_free(llm)


def test_preemption_and_chunked_prefill_keep_outputs_exact(tied_model):
    prompts = grounded_prompts([10, 17, 6, 15, 20, 4], seed=4)
    expected = hf_greedy(tied_model, prompts, 48)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with spec_llm(tied_model, num_kvcache_blocks=16, max_model_len=256, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_chunked_steps"] > 0
        assert [o["token_ids"] for o in outputs] == expected
        assert_drafts_accepted(llm)
        assert_all_blocks_free(llm)


def test_stopping_and_logprobs_match_no_speculation(tied_model):
    """Stop strings, stop tokens, EOS, max_tokens, min_tokens and logprobs see every accepted token, one at a time."""
    prompts = grounded_prompts([6, 9, 12, 20], seed=5)
    with spec_llm(tied_model, speculative_config=None) as plain:
        reference = plain.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
        text, tokens = reference["text"], reference["token_ids"]
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[text[len(text) // 2:][:3]]),
                  SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=3),
                  SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[tokens[20]], min_tokens=5),
                  SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=30, logprobs=2)]
        expected = plain.generate(prompts, params, use_tqdm=False)
    with spec_llm(tied_model) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_drafts_accepted(llm)
        assert_all_blocks_free(llm)
    for out, ref in zip(outputs, expected):
        assert out.outputs == ref.outputs
    assert outputs[0].outputs[0].finish_reason == "stop" and outputs[1].outputs[0].finish_reason == "length"


def test_seeded_sampling_is_the_same_with_and_without_speculation(tied_model):
    """A seeded sequence draws once per kept token, so speculation changes none of its tokens; nor does its batch."""
    prompts = grounded_prompts([5, 8, 11], seed=6)
    params = SamplingParams(temperature=0.3, max_tokens=MAX_TOKENS, ignore_eos=True, seed=11, n=2)
    with spec_llm(tied_model, speculative_config=None) as plain:
        expected = [o["token_ids"] for o in plain.generate(prompts, params, use_tqdm=False)]
    with spec_llm(tied_model) as llm:
        together = llm.generate(prompts, params, use_tqdm=False)
        assert_drafts_accepted(llm)
        alone = llm.generate(prompts[1:2], params, use_tqdm=False)[0]
        assert_all_blocks_free(llm)
    assert [o["token_ids"] for o in together] == expected
    assert alone["token_ids"] == expected[1]


def test_disable_by_batch_size_turns_proposals_off(tied_model):
    prompts = grounded_prompts([8, 9, 10], seed=7)
    with spec_llm(tied_model, speculative_config=dict(NGRAM, disable_by_batch_size=3)) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["num_draft_tokens"] == 0
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        assert llm.stats()["num_draft_tokens"] > 0
    assert [o["token_ids"] for o in outputs] == hf_greedy(tied_model, prompts, MAX_TOKENS)


def test_drafts_that_do_not_pay_a_costlier_verify_step_are_dropped(tied_model, monkeypatch):
    """Where a verify step costs more than a plain one (on CUDA: no graph replays it), drafts are kept only where
    they pay for it: none at 1,000 plain steps. With the runner's measured price (`VerifyPrice`, here told that a
    graph replay takes a nanosecond), the first verify step is tried, timed, and no other follows."""
    prompts = grounded_prompts([8], seed=5)
    expected = hf_greedy(tied_model, prompts, MAX_TOKENS)
    with monkeypatch.context() as patch:
        patch.setattr(ModelRunner, "verify_cost", lambda self, running: 1000.0)
        with spec_llm(tied_model) as llm:
            assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
            assert llm.stats()["num_draft_tokens"] == 0
    with spec_llm(tied_model) as llm:
        runner = llm.engine.model_runner
        runner.verify_price = VerifyPrice(max_graph_batch=8)
        runner.verify_price.replay_seconds[1] = 1e-9
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert llm.stats()["num_spec_rows"] == 1 and llm.stats()["num_draft_tokens"] > 0
        assert runner.verify_price.ratios.ratios[1] > 1000


def test_penalized_requests_run_without_drafts(tied_model):
    prompts = grounded_prompts([8], seed=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    with spec_llm(tied_model, speculative_config=None) as plain:
        expected = plain.generate(prompts, params, use_tqdm=False)[0]["token_ids"]
    with spec_llm(tied_model) as llm:
        assert llm.generate(prompts, params, use_tqdm=False)[0]["token_ids"] == expected
        assert llm.stats()["num_draft_tokens"] == 0


@pytest.mark.parametrize("spec, message", [
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "must be one of ['ngram', 'draft_model']"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens'] must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown speculative_config key(s)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "'prompt_lookup_min'] (4) is larger than 'prompt_lookup_max' (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "method 'ngram' takes neither"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "apply to method 'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "'disable_by_batch_size'] must be"),
    ("ngram", "speculative_config must be a dict"),
])
def test_bad_speculative_config_is_refused(tied_model, spec, message):
    with pytest.raises(ValueError) as error:
        LLM(tied_model, speculative_config=spec)
    assert message in str(error.value)


def test_draft_model_with_another_vocabulary_is_refused(tied_model, tmp_path):
    from checkpoints import make_checkpoint

    draft = make_checkpoint(str(tmp_path / "draft"), vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary of 320 tokens, the target .* 384"):
        LLM(tied_model, speculative_config={"model": draft, "num_speculative_tokens": 3})


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_windows_and_soft_capping_stay_exact(tmp_path, family):
    """Drafts verified over a window whose early blocks are released (Mistral, window 24, blocks of 16), and over
    alternating windows with capped scores (Gemma 2): transformers' greedy output still."""
    from checkpoints import make_family_checkpoint

    path = make_family_checkpoint(str(tmp_path / family), family, tie_word_embeddings=True)
    prompts = [p[:60] for p in grounded_prompts([30, 45])] + random_prompts([7], seed=3)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    with spec_llm(path, max_model_len=256, max_num_batched_tokens=64) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert_drafts_accepted(llm)
        if family == "mistral":
            assert llm.stats()["num_released_blocks"] > 0
        assert_all_blocks_free(llm)
