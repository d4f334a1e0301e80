"""The 8-bit KV caches (`kv_cache_dtype="fp8"`, and `"int8"` where said) through the engine: twice the blocks of a
16-bit cache in the same memory (four times float32's; int8's rows 4 bytes wider); a request's greedy tokens do not
depend on its batch, a prefix-cache hit, preemption or speculation (n-gram or a draft model, whose cache is 8-bit
too); it sleeps and wakes; and on the default model its distributions stay close to the full-precision cache's
(teacher-forced)."""
import pytest
import torch
from test_draft_model import draft_spec
from test_speculative import grounded_prompts, spec_llm

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.execution.draft_model import DraftModel

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def fp8_llm(path: str, **settings) -> LLM:
    return LLM(path, **dict(dict(device="cpu", dtype="float32", kv_cache_dtype="fp8", kvcache_block_size=16,
                                 max_model_len=256), **settings))


def test_unknown_kv_cache_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', "
                                         r"'int8'\], got 'int4'"):
        Config("model", kv_cache_dtype="int4")


def test_an_8bit_cache_on_the_cpu_needs_blocks_of_whole_key_tiles(tied_model):
    with pytest.raises(ValueError, match="K in tiles of 16 tokens on the CPU: kvcache_block_size must be a multiple "
                                         "of 16, got 8"):
        LLM(tied_model, device="cpu", kv_cache_dtype="fp8", kvcache_block_size=8)


@pytest.mark.parametrize("dtype, ratio", [("float32", 4), ("bfloat16", 2)])
def test_the_same_memory_holds_more_blocks(tied_model, dtype, ratio):
    def blocks(kv_cache_dtype: str) -> tuple[int, int]:
        with LLM(tied_model, device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=256,
                 kvcache_block_size=16, cpu_kvcache_gib=0.0005, max_num_seqs=64) as llm:
            cache = llm.engine.model_runner.kv_cache
            assert cache.tensor.dtype == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else
                                          torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else
                                          torch.uint8 if kv_cache_dtype == "int8" else cache.tensor.dtype)
            return cache.num_blocks, cache.tensor.size(-1)

    (full, head_dim), (fp8, _) = blocks("auto"), blocks("fp8")
    assert fp8 == blocks("fp8_e5m2")[0] and ratio * full <= fp8 < ratio * (full + 1)  # the budget // a block's bytes
    int8, width = blocks("int8")  # rows of head_dim bytes and a 4-byte scale
    assert width == head_dim + 4 and int8 == fp8 * head_dim // width


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_greedy_tokens_do_not_depend_on_the_batch_the_prefix_cache_or_preemption(tied_model, kv_cache_dtype):
    prompts = grounded_prompts([10, 17, 6, 15, 20, 4], seed=4)
    prompts[3] = prompts[1][:32] + prompts[3]  # shares two blocks with prompts[1]: a prefix-cache hit
    with fp8_llm(tied_model, kv_cache_dtype=kv_cache_dtype) as llm:
        alone = [llm.generate([p], GREEDY, use_tqdm=False)[0]["token_ids"] for p in prompts]
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == alone
    with fp8_llm(tied_model, kv_cache_dtype=kv_cache_dtype, num_kvcache_blocks=16,
                 max_num_batched_tokens=32) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == alone
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_chunked_steps"] > 0
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256) as llm:
        full = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert full != alone, "the 8-bit cache changes some token of this random model: the cache was really 8-bit"


def test_speculation_is_token_identical_over_an_8bit_cache(tied_model):
    prompts = grounded_prompts([10, 17, 6, 15], seed=5)
    with fp8_llm(tied_model) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with spec_llm(tied_model, kv_cache_dtype="fp8", max_model_len=256) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert llm.stats()["num_accepted_tokens"] > 0


def test_a_draft_model_s_cache_is_8bit_too_and_speculation_stays_token_identical(tied_model, monkeypatch):
    monkeypatch.setattr(DraftModel, "forward_ratio", lambda self, num_seqs: 0.0)  # always speculate
    prompts = grounded_prompts([3, 12, 30], seed=6)
    with fp8_llm(tied_model) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    spec = draft_spec(tied_model, quantization="int8")
    with spec_llm(tied_model, kv_cache_dtype="fp8", max_model_len=256, speculative_config=spec) as llm:
        assert llm.engine.model_runner.drafter.kv_cache.tensor.dtype == torch.float8_e4m3fn
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert llm.stats()["num_accepted_tokens"] > 0


def test_an_8bit_cache_sleeps_and_wakes(tied_model):
    prompts = grounded_prompts([10, 17], seed=7)
    with fp8_llm(tied_model, enable_sleep_mode=True) as llm:
        before = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        llm.sleep(level=1)
        llm.wake_up()
        assert llm.engine.model_runner.kv_cache.tensor.dtype == torch.float8_e4m3fn
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before


def teacher_forced_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """The logits at every position of `token_ids`, each predicting the next from the ones before (a prompt's
    logprobs make the engine compute them all)."""
    model, logits = llm.engine.model_runner.model, []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden_states: logits.append(compute_logits(hidden_states)) or logits[-1]
    try:
        llm.generate([token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        model.compute_logits = compute_logits
    return logits[0].float()


def test_the_default_model_s_distributions_stay_close_to_the_full_precision_cache():
    """SmolLM2-135M-Instruct (Q4_1), float32, teacher-forced over 1,000 tokens of a text that never changes (the Python
    reference's chapter on the execution model, from the standard library): fp8 (e4m3) and int8 against the float32
    cache. Measured: e4m3 top-1 93.8-94.8%, mean KL 0.013-0.014; int8 95.8%, 0.0045; the model in float16 (its cache
    too) against float32: 96.5%, 0.0035, K/V alone rounded to float16 96.6%, 0.0034 (this model's distributions are
    flat: a float16 cache misses 98% too). The issue asked 98% and 0.01: e4m3's 3-bit mantissas miss both on this
    model (the values are not small: 2% lie below e4m3's normal range), and a text the model wrote itself moved the
    figures by 3 points whenever decoding's rounding changed its greedy essay; the bounds here catch a broken cache."""
    nanovllm = pytest.importorskip("nanovllm")
    from pydoc_data.topics import topics

    try:
        model = nanovllm.default_model()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))
    settings = dict(device="cpu", dtype="float32", max_model_len=1024, enable_prefix_caching=False)
    with LLM(model, **settings) as llm:
        text = llm.get_tokenizer().encode(topics["execmodel"])[:1000]
        full = teacher_forced_logits(llm, text)
    with LLM(model, kv_cache_dtype="fp8", **settings) as llm:
        fp8 = teacher_forced_logits(llm, text)
    with LLM(model, kv_cache_dtype="int8", **settings) as llm:
        int8 = teacher_forced_logits(llm, text)
    for logits, least_top1, most_kl in ((fp8, 0.92, 0.02), (int8, 0.95, 0.01)):
        kl = (full.softmax(-1) * (full.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)
        top1 = (full.argmax(-1) == logits.argmax(-1)).float().mean().item()
        assert top1 >= least_top1 and kl.mean().item() < most_kl, (top1, kl.mean().item())
