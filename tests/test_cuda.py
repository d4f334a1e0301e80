"""The CUDA path on a real GPU (skipped without one; `.ci/gpu` runs these).

flash-attn vs the torch backend on random inputs, the compiled Triton K/V writer vs torch,
greedy parity with transformers (float32, torch attention; bfloat16, flash-attn, with and
without CUDA graphs), graph replay vs eager decode, and KV-cache sizing from
gpu_memory_utilization.
"""
import gc
import random

import pytest
import torch
from transformers import Qwen3ForCausalLM

from checkpoints import hf_greedy, make_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.backends import TorchBackend, importable
from nanovllm.execution.cuda_graph import pick_batch_size
from nanovllm.execution.model_runner import blocks_per_sequence
from nanovllm.utils import compile as compile_mod
from nanovllm.utils.context import Context, get_context, reset_context

pytestmark = pytest.mark.cuda
needs_flash = pytest.mark.skipif(not importable("flash_attn"), reason="flash-attn is not installed")

BLOCK = 256
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
SCALE = HEAD_DIM ** -0.5
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory) -> str:
    """flash-attn needs head_dim a multiple of 8; 64 also keeps the model tiny."""
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-gpu")), hidden_size=128, num_heads=4, num_kv_heads=2,
                           head_dim=64, intermediate_size=256, max_position_embeddings=1024, seed=3)


@pytest.fixture(autouse=True)
def release_gpu_memory():
    yield
    reset_context()
    gc.collect()
    torch.cuda.empty_cache()


def rand(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(dtype)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)


def random_block_tables(lengths: list[int], num_blocks: int) -> torch.Tensor:
    """Distinct, shuffled blocks per sequence, padded with -1 as the model runner does."""
    needed = [-(-n // BLOCK) for n in lengths]
    ids = random.Random(0).sample(range(num_blocks), sum(needed))
    width, rows = max(needed), []
    for n in needed:
        rows.append(ids[:n] + [-1] * (width - n))
        ids = ids[n:]
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def fp32(ctx_tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.float() for t in ctx_tensors)


def flash():
    from nanovllm.backends.flash_backend import FlashBackend

    return FlashBackend


@needs_flash
def test_flash_prefill_equals_torch_prefill():
    torch.manual_seed(0)
    lengths = [1, 17, 300, 64]
    q, k, v = rand(sum(lengths), HEADS, HEAD_DIM), rand(sum(lengths), KV_HEADS, HEAD_DIM), rand(sum(lengths), KV_HEADS, HEAD_DIM)
    cu = cu_seqlens(lengths)
    ctx = Context(True, cu, cu, max(lengths), max(lengths))
    empty = torch.tensor([], device="cuda")
    out = flash().prefill(q, k, v, empty, empty, ctx, SCALE)
    ref = TorchBackend.prefill(*fp32((q, k, v)), empty, empty, ctx, SCALE)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@needs_flash
def test_flash_prefill_with_cached_prefix_equals_torch_prefill():
    torch.manual_seed(1)
    total, cached = [300, 600, 20, 512], [256, 512, 0, 256]
    new = [t - c for t, c in zip(total, cached)]
    num_blocks = 24
    k_cache, v_cache = rand(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), rand(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    tables = random_block_tables(total, num_blocks)
    slots = [int(tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK
             for i, (t, c) in enumerate(zip(total, cached)) for pos in range(c, t)]
    q, k, v = rand(sum(new), HEADS, HEAD_DIM), rand(sum(new), KV_HEADS, HEAD_DIM), rand(sum(new), KV_HEADS, HEAD_DIM)
    TorchBackend.store_kvcache(k, v, k_cache, v_cache, torch.tensor(slots, device="cuda"))
    ctx = Context(True, cu_seqlens(new), cu_seqlens(total), max(new), max(total), block_tables=tables)
    out = flash().prefill(q, k, v, k_cache, v_cache, ctx, SCALE)
    ref = TorchBackend.prefill(*fp32((q, k, v, k_cache, v_cache)), ctx, SCALE)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@needs_flash
def test_flash_paged_decode_equals_torch_decode():
    torch.manual_seed(2)
    lengths = [1, 255, 256, 257, 1000]
    num_blocks = 16
    k_cache, v_cache = rand(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), rand(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    ctx = Context(False, context_lens=torch.tensor(lengths, dtype=torch.int32, device="cuda"),
                  block_tables=random_block_tables(lengths, num_blocks))
    q = rand(len(lengths), HEADS, HEAD_DIM)
    out = flash().decode(q, k_cache, v_cache, ctx, SCALE)
    ref = TorchBackend.decode(*fp32((q, k_cache, v_cache)), ctx, SCALE)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_triton_store_equals_torch_store(dtype):
    from nanovllm.backends.triton_kv import store_kvcache

    torch.manual_seed(3)
    qkv = rand(9, 3 * KV_HEADS * HEAD_DIM, dtype=dtype)
    k, v = (t.view(9, KV_HEADS, HEAD_DIM) for t in qkv.split(KV_HEADS * HEAD_DIM, -1)[1:])
    slots = torch.tensor([17, -1, 3, 0, 1000, -1, 8, 512, 4], device="cuda")
    ref = rand(2, 4, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    out = ref.clone()
    TorchBackend.store_kvcache(k, v, ref[0], ref[1], slots)
    store_kvcache(k, v, out[0], out[1], slots)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_greedy_parity_with_transformers_float32(gpu_model, enforce_eager):
    """float32 runs the torch attention backend on CUDA (flash-attn has no fp32) with Triton K/V writes,
    decoding eagerly; without enforce_eager the fused ops are compiled."""
    rng = random.Random(4)
    shared = [rng.randrange(384) for _ in range(40)]
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (1, 7, 33)] + [shared + [1, 2], shared + [3]]
    expected = hf_greedy(gpu_model, prompts, GREEDY.max_tokens)
    with LLM(gpu_model, dtype="float32", kvcache_block_size=16, enforce_eager=enforce_eager) as llm:
        assert llm.model_runner.backend.name == "torch+triton" and llm.model_runner.graphs is None
        assert compile_mod._enabled != enforce_eager
        outputs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
        outputs += llm.generate(prompts[3:], GREEDY, use_tqdm=False)
        assert llm.stats()["num_cached_tokens"] > 0
    assert [o["token_ids"] for o in outputs] == expected


@needs_flash
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_flash_bfloat16_generation_follows_transformers(gpu_model, enforce_eager):
    """bfloat16 cannot match float32 token for token, so each generated token is checked against
    transformers' float32 logits for the same sequence: it must be the argmax up to bf16 rounding
    (measured on CPU: |bf16 - fp32| logits <= 0.1, top-1 deficit of bf16's pick <= 0.04)."""
    from nanovllm.backends.flash_backend import FlashBackend

    rng = random.Random(5)
    shared = [rng.randrange(384) for _ in range(300)]
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (1, 250, 600)] + [shared + [1], shared + [2, 3]]
    with LLM(gpu_model, dtype="bfloat16", enforce_eager=enforce_eager) as llm:
        runner = llm.model_runner
        assert issubclass(runner.backend, FlashBackend) and (runner.graphs is None) == enforce_eager
        replays = []
        if runner.graphs is not None:
            run = runner.graphs.run
            runner.graphs.run = lambda *args: replays.append(args[0].size(0)) or run(*args)
        outputs = llm.generate(prompts[:3] + prompts[3:4], GREEDY, use_tqdm=False)
        outputs += llm.generate(prompts[4:], GREEDY, use_tqdm=False)
        assert llm.stats()["num_cached_tokens"] >= BLOCK
    assert bool(replays) != enforce_eager
    hf = Qwen3ForCausalLM.from_pretrained(gpu_model, dtype=torch.float32).eval()
    exact = total = 0
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([prompt + out["token_ids"]])).logits[0, len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(out["token_ids"])[:, None])[:, 0]
        deficit = logits.max(-1).values - chosen
        assert deficit.max() <= 0.15, (prompt[:5], out["token_ids"], deficit.tolist())
        exact += int((deficit == 0).sum())
        total += len(deficit)
    assert exact >= 0.9 * total


@needs_flash
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("batch_size", [1, 3, 17, 100])
def test_graph_replay_equals_eager_decode(gpu_model, dtype, batch_size):
    rng = random.Random(batch_size)
    with LLM(gpu_model, dtype=dtype, max_num_seqs=128, enforce_eager=False) as llm:
        runner = llm.model_runner
        assert pick_batch_size(runner.graphs.sizes, batch_size) >= batch_size
        for _ in range(batch_size):
            llm.add_request([rng.randrange(384) for _ in range(rng.randint(1, 400))], GREEDY)
        batch = llm.scheduler.schedule()
        while batch.num_decode_tokens < len(batch):  # until every request has its prompt computed
            llm.scheduler.postprocess(batch, runner.run(batch))
            batch = llm.scheduler.schedule()
        assert len(batch) == batch_size
        input_ids, positions = runner.prepare(batch)
        with torch.inference_mode():
            replayed = runner.graphs.run(input_ids, positions, get_context()).clone()
            eager = runner.model(input_ids, positions)
        torch.testing.assert_close(replayed, eager, atol=3e-2, rtol=3e-2)


def test_kv_cache_is_sized_from_gpu_memory_utilization(gpu_model):
    """Leave 256 MiB above what is in use now: the cache gets at most that, well under the 512 MiB that
    max_num_seqs full-length sequences could use, so the memory budget (not that cap) decides."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    headroom = 256 * 2**20
    utilization = (total - free + headroom) / total
    with LLM(gpu_model, dtype="bfloat16", gpu_memory_utilization=utilization) as llm:
        config = llm.config
        cap = config.max_num_seqs * blocks_per_sequence(config)
        assert blocks_per_sequence(config) <= config.num_kvcache_blocks < cap
        assert config.num_kvcache_blocks * llm.model_runner.kv_block_bytes() <= headroom
        used = total - torch.cuda.mem_get_info()[1]
        assert used <= utilization * total + 256 * 2**20  # CUDA graphs' pool and library workspaces


def test_too_little_gpu_memory_is_a_clear_error(gpu_model):
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = (total - free + 2**20) / total
    with pytest.raises(ValueError, match="the KV cache holds 0 blocks .*gpu_memory_utilization"):
        LLM(gpu_model, dtype="bfloat16", gpu_memory_utilization=utilization)
