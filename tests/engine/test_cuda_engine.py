"""The engine on a real GPU, with each attention backend that can run there (skipped without a GPU).

float32 (torch and Triton attention): token-exact against transformers run on the same GPU, with prefix-cache
hits, mixed batches and preemption, and the same tokens whether a request runs in a batch, over its cached
prefix or alone. bfloat16, every backend: each token of each of those runs is transformers' argmax up to
bfloat16 rounding. Bad input is rejected on CUDA as on CPU, and the engine keeps serving.
"""
import gc
import random

import pytest
import torch
from checkpoints import hf_greedy
from cuda_backends import BACKENDS, require_backend
from transformers import Qwen3ForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.attention.kv_quant import INT8_CACHE

pytestmark = pytest.mark.cuda

HEAD_DIM = 64  # the gpu_model fixture's
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(autouse=True)
def release_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def block_size_for(name: str) -> int:
    """flash-attn 2 needs 256; the others take small blocks, which give more cache hits and block edges."""
    return 256 if name == "flash-attn" else 16


def prompts_with_shared_prefixes(seed: int, block_size: int, one_token_chunk: bool = True) -> list[list[int]]:
    """Lone prompts across block edges, and prompts sharing a two-block prefix (cache hits on a second pass).
    A prompt one token past a block edge is prefilled, once its first block is cached, as a one-token chunk."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(384) for _ in range(n)]
    shared = tokens(2 * block_size + 7)
    lengths = (1, 7, block_size, block_size + (1 if one_token_chunk else 2), 300)
    return [tokens(n) for n in lengths] + [shared + tokens(3), shared + tokens(40)]


def token_ids(outputs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_float32_greedy_equals_transformers_on_the_same_gpu(gpu_model, name, enforce_eager):
    block_size = block_size_for(name)
    backend = require_backend(name, torch.float32, block_size, HEAD_DIM)
    prompts = prompts_with_shared_prefixes(4, block_size)
    expected = hf_greedy(gpu_model, prompts, GREEDY.max_tokens, device="cuda")
    with LLM(gpu_model, dtype="float32", attention_backend=name, kvcache_block_size=block_size,
             enforce_eager=enforce_eager, max_num_seqs=16) as llm:
        assert llm.engine.model_runner.backend.name == backend.name
        assert (llm.engine.model_runner.graphs is not None) == (backend.capturable and not enforce_eager)
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.stats()["num_cached_tokens"] >= 2 * block_size
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_float32_preemption_keeps_tokens_exact_on_the_gpu(gpu_model, name):
    require_backend(name, torch.float32, 16, HEAD_DIM)
    rng = random.Random(5)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (30, 50, 20, 45, 60, 10)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = hf_greedy(gpu_model, prompts, 48, device="cuda")
    with LLM(gpu_model, dtype="float32", attention_backend=name, kvcache_block_size=16, num_kvcache_blocks=16,
             max_model_len=256, max_num_seqs=16) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_all_blocks_free(llm)


def generate_three_ways(llm: LLM, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """The same greedy requests all in one batch, again over their cached prefixes, then one at a time."""
    batched = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    cached = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.stats()["num_cached_tokens"] >= 2 * llm.config.kvcache_block_size
    alone = [token_ids(llm.generate([prompt], GREEDY, use_tqdm=False))[0] for prompt in prompts]
    assert_all_blocks_free(llm)
    return {"batched": batched, "cached": cached, "alone": alone}


@pytest.mark.parametrize("name", BACKENDS)
def test_float32_tokens_do_not_depend_on_cache_hits_or_the_batch(gpu_model, name):
    """With CUDA graphs where the backend has them (decode batches of 7 and of 1 replay different graphs)."""
    block_size = block_size_for(name)
    require_backend(name, torch.float32, block_size, HEAD_DIM)
    prompts = prompts_with_shared_prefixes(6, block_size)
    with LLM(gpu_model, dtype="float32", attention_backend=name, kvcache_block_size=block_size,
             max_num_seqs=16) as llm:
        runs = generate_three_ways(llm, prompts)
    assert runs["cached"] == runs["batched"]
    assert runs["alone"] == runs["batched"]


@pytest.mark.parametrize("name", BACKENDS)
def test_float32_ngram_speculation_beside_the_graphs_is_exact_and_priced(gpu_model, name):
    """Verify steps run eagerly beside the decode graphs: the output is transformers', and the runner has timed both
    kinds of step (`VerifyPrice`: speculation tried at least once for a batch size that replays a graph)."""
    block_size = block_size_for(name)
    backend = require_backend(name, torch.float32, block_size, HEAD_DIM)
    if not backend.capturable:
        pytest.skip(f"{name} runs decode without graphs")
    rng = random.Random(9)
    prompts = [[rng.randrange(384) for _ in range(n)] * 3 for n in (12, 20, 7)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = hf_greedy(gpu_model, prompts, 32, device="cuda")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    with LLM(gpu_model, dtype="float32", attention_backend=name, kvcache_block_size=block_size, max_num_seqs=16,
             speculative_config=spec) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert [token_ids(llm.generate([p], params, use_tqdm=False))[0] for p in prompts] == expected
        price = llm.engine.model_runner.verify_price
        assert price.replay_seconds and price.ratios.ratios
        assert llm.stats()["num_draft_tokens"] > 0
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("name", BACKENDS)
def test_float32_tokens_over_an_8bit_cache_do_not_depend_on_cache_hits_or_the_batch(gpu_model, name, kv_cache_dtype):
    """kv_cache_dtype="fp8" and "int8" on the backends that read them, with their CUDA graphs (the others refuse
    them: see test_kv_cache_8bit.py, test_kv_cache_int8.py). float32 only: in bfloat16 cuBLAS rounds a row differently
    with the number of rows (see the test below); on an H100 the torch backend's bfloat16 tokens did differ between
    batches."""
    block_size = block_size_for(name)
    cache = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": INT8_CACHE}[kv_cache_dtype]
    backend = require_backend(name, torch.float32, block_size, HEAD_DIM, cache)
    prompts = prompts_with_shared_prefixes(8, block_size)
    with LLM(gpu_model, dtype="float32", kv_cache_dtype=kv_cache_dtype, attention_backend=name,
             kvcache_block_size=block_size, max_num_seqs=16) as llm:
        runner = llm.engine.model_runner
        assert runner.kv_cache.tensor.dtype == cache
        assert (runner.graphs is not None) == backend.capturable
        runs = generate_three_ways(llm, prompts)
    assert runs["cached"] == runs["batched"]
    assert runs["alone"] == runs["batched"]


@pytest.mark.parametrize("name", BACKENDS)
def test_bfloat16_tokens_are_transformers_argmax_up_to_rounding(gpu_model, name):
    """bfloat16 cannot match float32 token for token, so every token of every run (batched, over cached
    prefixes, alone) is checked against transformers' float32 logits for the same sequence: it must be the
    argmax up to bf16 rounding (measured on CPU: |bf16 - fp32| logits <= 0.1, top-1 deficit of bf16's pick
    <= 0.04). Runs may then differ only where two tokens tie within that rounding: cuBLAS picks its matmul
    kernels by the number of rows, so bfloat16 rows round differently in different batches. That the
    attention itself is bit-identical across cache hits and batches is test_cuda.py's
    test_attention_rows_do_not_depend_on_cache_hits_or_the_batch. flash-attn 2 is spared the one-token
    chunk: it runs that through its decode kernel (see FlashBackend)."""
    block_size = block_size_for(name)
    backend = require_backend(name, torch.bfloat16, block_size, HEAD_DIM)
    prompts = prompts_with_shared_prefixes(7, block_size, one_token_chunk=name != "flash-attn")
    with LLM(gpu_model, dtype="bfloat16", attention_backend=name, kvcache_block_size=block_size,
             max_num_seqs=16) as llm:
        runner, replays = llm.engine.model_runner, []
        assert (runner.graphs is not None) == backend.capturable
        if runner.graphs is not None:
            run = runner.graphs.run
            runner.graphs.run = lambda *args: replays.append(args[0].size(0)) or run(*args)
        runs = generate_three_ways(llm, prompts)
    assert bool(replays) == backend.capturable
    hf = Qwen3ForCausalLM.from_pretrained(gpu_model, dtype=torch.float32).to("cuda").eval()
    exact = total = 0
    for outputs in runs.values():
        for prompt, out in zip(prompts, outputs):
            with torch.inference_mode():
                logits = hf(input_ids=torch.tensor([prompt + out], device="cuda")).logits[0, len(prompt) - 1:-1]
            chosen = logits.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
            deficit = logits.max(-1).values - chosen
            assert deficit.max() <= 0.15, (prompt[:5], out, deficit.tolist())
            exact += int((deficit == 0).sum())
            total += len(deficit)
    assert exact >= 0.9 * total


def test_bad_requests_are_rejected_on_the_gpu_and_the_engine_still_serves(gpu_model):
    good = [5, 6, 7, 8]
    expected = hf_greedy(gpu_model, [good], GREEDY.max_tokens, device="cuda")[0]
    with LLM(gpu_model, dtype="float32", max_model_len=128, kvcache_block_size=16) as llm:
        for prompts, message in [([good, []], "prompt 1 is empty"),
                                 ([good, [1] * 129], "longer than the maximum model length of 128"),
                                 ([[1, 384]], "token id 384 is out of vocabulary")]:
            with pytest.raises(ValueError, match=message):
                llm.generate(prompts, GREEDY, use_tqdm=False)
            assert llm.is_finished()
            assert_all_blocks_free(llm)
        assert llm.generate([good], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
