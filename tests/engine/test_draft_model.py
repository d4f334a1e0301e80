"""Speculative decoding with a draft model: a smaller random model, the target quantized at load (int8) or a GGUF
copy of it. Greedy output is transformers' token for token, seeded sampling the same as without speculation, whatever
the batch, the cache or preemption; every block is freed; a draft that cannot serve the target is refused."""
from dataclasses import replace

import pytest
from checkpoints import hf_greedy, make_checkpoint
from test_engine_parity import assert_all_blocks_free, random_prompts
from test_speculative import GREEDY, MAX_TOKENS, assert_drafts_accepted, grounded_prompts, spec_llm

from nanovllm import LLM, SamplingParams
from nanovllm.execution.draft_model import DraftModel


@pytest.fixture(autouse=True)
def free_drafts(monkeypatch):
    """Draft forwards priced at nothing, so that every test speculates (tiny models' forwards cost about the same
    whatever their size, so the adaptive rule would mostly turn speculation off); spawned replicas price them."""
    monkeypatch.setattr(DraftModel, "forward_ratio", lambda self, num_seqs: 0.0)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory) -> str:
    """Another shape (1 layer, hidden 32, 1 KV head): its cache is shaped unlike the target's; it agrees rarely."""
    return make_checkpoint(str(tmp_path_factory.mktemp("draft")), seed=5, num_layers=1, hidden_size=32, num_heads=2,
                           num_kv_heads=1, head_dim=16, intermediate_size=64)


def draft_spec(model: str, k: int = 4, **extra) -> dict:
    return {"model": model, "num_speculative_tokens": k, **extra}


def test_greedy_equals_transformers_with_either_draft_mixed_lengths_and_prefix_cache(tied_model, small_draft):
    prompts = grounded_prompts([1, 3, 12, 30]) + random_prompts([5, 40], seed=9)
    expected = hf_greedy(tied_model, prompts, MAX_TOKENS)
    for spec in (draft_spec(small_draft, 3), draft_spec(tied_model, quantization="int8")):
        with spec_llm(tied_model, speculative_config=spec) as llm:
            first = llm.generate(prompts, GREEDY, use_tqdm=False)
            cached = llm.stats()["num_cached_tokens"]
            second = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert llm.stats()["num_cached_tokens"] > cached
            assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second] == expected
            assert_drafts_accepted(llm)
            assert_all_blocks_free(llm)
            if "quantization" in spec:
                assert llm.stats()["spec_acceptance_rate"] > 0.8


def test_preemption_and_chunked_prefill_keep_outputs_exact(tied_model, small_draft):
    prompts = random_prompts([10, 17, 6, 15, 20, 4], seed=4)
    expected = hf_greedy(tied_model, prompts, 48)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with spec_llm(tied_model, speculative_config=draft_spec(small_draft), num_kvcache_blocks=16,
                  max_model_len=256, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_chunked_steps"] > 0
        assert [o["token_ids"] for o in outputs] == expected
        assert_drafts_accepted(llm)
        assert_all_blocks_free(llm)


def test_stopping_logprobs_and_seeded_sampling_match_no_speculation(tied_model, small_draft):
    """Stop strings and tokens, max_tokens, min_tokens and logprobs see every accepted token one at a time; a seeded
    request's draws are those without speculation (its drafts are point masses), alone or in a batch."""
    prompts = random_prompts([6, 9, 12, 20, 8], seed=5)
    with spec_llm(tied_model, speculative_config=None) as plain:
        reference = plain.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
        text, tokens = reference["text"], reference["token_ids"]
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[text[len(text) // 2:][:3]]),
                  SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=3),
                  SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[tokens[20]], min_tokens=5),
                  SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=30, logprobs=2),
                  SamplingParams(temperature=0.8, top_k=40, max_tokens=MAX_TOKENS, ignore_eos=True, seed=11)]
        expected = plain.generate(prompts, params, use_tqdm=False)
    for draft in (tied_model, small_draft):
        quantization = "int8" if draft == tied_model else None
        with spec_llm(tied_model, speculative_config=draft_spec(draft, quantization=quantization)) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.stats()["num_accepted_tokens"] > 0
            alone = llm.generate(prompts[4:], params[4:], use_tqdm=False)[0]
            assert_all_blocks_free(llm)
        for out, ref in zip(outputs, expected):
            assert out.outputs == ref.outputs
        assert alone.outputs == expected[4].outputs
    assert outputs[0].outputs[0].finish_reason == "stop" and outputs[1].outputs[0].finish_reason == "length"


def test_a_gguf_copy_of_the_target_drafts_for_it(tmp_path, private_cache):
    """Self-speculation with a Q8_0 GGUF file of the target (its vocabulary read from the file's metadata)."""
    from checkpoints import make_gguf

    target = make_checkpoint(str(tmp_path / "llama"), family="llama", tie_word_embeddings=False, seed=5)
    draft = make_gguf(str(tmp_path / "llama-q8_0.gguf"), target, "", qtype="Q8_0", quantized=("",))
    prompts = grounded_prompts([7, 20], seed=2)
    with spec_llm(target, speculative_config=draft_spec(draft)) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["spec_acceptance_rate"] > 0.7
        assert_all_blocks_free(llm)
    assert [o["token_ids"] for o in outputs] == hf_greedy(target, prompts, MAX_TOKENS)


def test_the_draft_catches_up_within_the_token_budget(tied_model, small_draft, monkeypatch):
    """A sequence's first speculation catches the draft up on its whole prompt: in forwards of at most
    max_num_batched_tokens tokens (the target's bound), a prompt split where a forward fills up; outputs exact."""
    sizes = []
    original = DraftModel._forward
    monkeypatch.setattr(DraftModel, "_forward", lambda self, chunks, *wanted: sizes.append(
        sum(len(chunk.tokens) for chunk in chunks)) or original(self, chunks, *wanted))
    prompts = random_prompts([70, 45, 9], seed=11)
    with spec_llm(tied_model, speculative_config=draft_spec(small_draft), max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_drafts_accepted(llm)
        assert_all_blocks_free(llm)
    assert [o["token_ids"] for o in outputs] == hf_greedy(tied_model, prompts, MAX_TOKENS)
    assert max(sizes) == 32 and sum(size == 32 for size in sizes) >= 3, sizes


def test_draft_model_refusals(tied_model, tmp_path):
    short = make_checkpoint(str(tmp_path / "short"), max_position_embeddings=128)
    with pytest.raises(ValueError, match="handles 128 tokens, fewer than max_model_len=1024"):
        spec_llm(tied_model, speculative_config=draft_spec(short))
    with pytest.raises(ValueError, match=r"speculative_config\['quantization'\] must be one of"):
        LLM(tied_model, speculative_config=draft_spec(tied_model, quantization="int3"))
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only"):
        LLM(tied_model, device="cpu", tensor_parallel_size=2, speculative_config=draft_spec(tied_model))
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        LLM(tied_model, speculative_config=draft_spec(str(tmp_path / "missing")))
    from checkpoints import make_family_checkpoint

    mistral = make_family_checkpoint(str(tmp_path / "mistral"), "mistral", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="releases KV blocks outside its sliding window"):
        LLM(mistral, speculative_config=draft_spec(mistral))


def test_metrics_are_vllms_and_data_parallel_replicas_recompute_rates(tied_model):
    """get_metrics() names vLLM's speculative decoding counters; with two replicas, each is labelled by its engine
    and the summed stats' rates come from the summed counters."""
    from nanovllm.metrics import Counter, Vector

    prompts = grounded_prompts([6, 9, 14, 20], seed=3)
    for dp in (1, 2):
        spec = draft_spec(tied_model, quantization="int8")  # replicas price drafts: few steps speculate
        with spec_llm(tied_model, speculative_config=spec, data_parallel_size=dp) as llm:
            assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
                hf_greedy(tied_model, prompts, MAX_TOKENS)
            stats, metrics = llm.stats(), llm.get_metrics()
        engines = [stats] if dp == 1 else stats["replicas"]
        assert {m.labels["engine"] for m in metrics} == {str(i) for i in range(dp)}
        for i, engine in enumerate(engines):
            mine = {m.name: m for m in metrics if m.labels["engine"] == str(i)}
            assert isinstance(mine["vllm:spec_decode_num_drafts"], Counter)
            assert mine["vllm:spec_decode_num_drafts"].value == engine["num_spec_rows"]
            assert mine["vllm:spec_decode_num_draft_tokens"].value == engine["num_draft_tokens"]
            accepted, per_position = mine["vllm:spec_decode_num_accepted_tokens"], \
                mine["vllm:spec_decode_num_accepted_tokens_per_pos"]
            assert isinstance(per_position, Vector) and len(per_position.values) == 4
            assert accepted.value == sum(per_position.values) == engine["num_accepted_tokens"]
            assert per_position.values == sorted(per_position.values, reverse=True)
        assert stats["num_accepted_tokens"] == sum(e["num_accepted_tokens"] for e in engines) > 0
        assert stats["spec_acceptance_rate"] == stats["num_accepted_tokens"] / stats["num_draft_tokens"]
        assert stats["spec_mean_accepted_length"] == 1 + stats["num_accepted_tokens"] / stats["num_spec_rows"]


def test_the_draft_models_cost_decides_how_deep_it_drafts():
    """Every sequence drafts to the depth that pays: all of its room when draft forwards are cheap, none when each
    costs as much as a target step, and sequences whose drafts are mostly rejected pull the depth down."""
    from nanovllm.core.sequence import Sequence
    from nanovllm.spec_decode.proposer import keep_model_drafts

    seqs = [Sequence(i, [1, 2, 3], 16, SamplingParams()) for i in range(4)]
    for seq in seqs:
        seq.spec_trials, seq.spec_accepted = 40, 39
    proposals = {seq: [0] * 5 for seq in seqs}
    assert set(keep_model_drafts(proposals, 4, 4, (8, 8), 0.05).values()) == {5}
    assert set(keep_model_drafts(proposals, 4, 4, (8, 8), 1.0).values()) == {0}
    for seq in seqs:
        seq.spec_trials, seq.spec_accepted = 40, 10
    assert 0 < max(keep_model_drafts(proposals, 4, 4, (8, 8), 0.05).values()) < 5


def test_the_draft_models_forwards_are_part_of_a_steps_price():
    """What a proposal's step costs beyond the target's forward (its d draft forwards at `forward_ratio` each), for
    the engine's pricing of drafts against a step that costs more with them (`drafts_pay`)."""
    from nanovllm.config import STEP_COST, parse_speculative_config
    from nanovllm.core.sequence import Sequence
    from nanovllm.spec_decode.proposer import DraftModelProposer

    spec = parse_speculative_config({"model": "draft", "num_speculative_tokens": 3})
    proposer = DraftModelProposer(replace(spec, step_cost=STEP_COST["cuda"]), 64, lambda num_seqs: 0.1)
    seq = Sequence(0, [1, 2, 3], 16, SamplingParams())
    seq.num_computed_tokens = 2
    proposer.propose([seq])
    assert seq.spec_token_ids == [0] * 3 and proposer.draft_factor == pytest.approx(1.3)
    seq.params = SamplingParams(max_tokens=1)  # no room for drafts: nothing drafted, nothing to pay
    proposer.propose([seq])
    assert seq.spec_token_ids == [] and proposer.draft_factor == 1.0


def test_a_draft_turned_off_by_batch_size_runs_no_forward(tied_model, small_draft, monkeypatch):
    forwards = []
    original = DraftModel._forward
    monkeypatch.setattr(DraftModel, "_forward", lambda self, chunks, *wanted: forwards.append(len(chunks)) or
                        original(self, chunks, *wanted))
    prompts = random_prompts([8, 9, 10], seed=7)
    with spec_llm(tied_model, speculative_config=draft_spec(small_draft, disable_by_batch_size=3)) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
            hf_greedy(tied_model, prompts, MAX_TOKENS)
        assert llm.stats()["num_draft_tokens"] == 0 and forwards == []
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        assert llm.stats()["num_draft_tokens"] > 0 and forwards
