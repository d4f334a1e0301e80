"""The attention backends, CUDA graphs and KV-cache sizing on a real GPU (skipped without one; `.ci/gpu` runs them).

Every backend that can run here (torch, triton, flash-attn, flash-attn-4) is checked against a float64
reference on the same paged cache, and for the property that keeps a request's tokens independent
of prefix-cache hits and of its batch: a query row's output is bit-identical whether it is computed
in a whole prefill or in a chunk over the cached prefix, alone or among other sequences.
"""
import gc
import random

import pytest
import torch
from cuda_backends import BACKENDS, require_backend

from nanovllm import LLM, SamplingParams
from nanovllm.execution.cuda_graph import pick_batch_size
from nanovllm.execution.kv_cache import kv_block_bytes
from nanovllm.kernels.attention.context import Context, get_context, reset_context
from nanovllm.kernels.attention.torch_backend import TorchBackend

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
BLOCK = 256
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
SCALE = HEAD_DIM ** -0.5
NUM_BLOCKS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def release_gpu_memory():
    yield
    reset_context()
    gc.collect()
    torch.cuda.empty_cache()


def rand(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


class PagedCache:
    """A random paged K/V cache and distinct, shuffled blocks for named sequences."""

    def __init__(self, dtype: torch.dtype, seed: int = 0):
        torch.manual_seed(seed)
        self.k, self.v = rand(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype).unbind(0)
        self.free = random.Random(seed).sample(range(NUM_BLOCKS), NUM_BLOCKS)
        self.tables: dict[str, list[int]] = {}

    def table(self, name: str, length: int) -> list[int]:
        if name not in self.tables:
            needed = -(-length // BLOCK)
            self.tables[name], self.free = self.free[:needed], self.free[needed:]
        return self.tables[name]

    def context(self, seqs: list[tuple[str, int, int]]) -> Context:
        """The step's context for (name, context length, query count) per sequence, as the runner builds it."""
        tables = [self.table(name, length) for name, length, _ in seqs]
        width = max(map(len, tables))
        lengths, q_lens = [length for _, length, _ in seqs], [n for _, _, n in seqs]
        cumsum = lambda xs: int32([0] + xs).cumsum(0, dtype=torch.int32)
        return Context(cu_seqlens_q=cumsum(q_lens), cu_seqlens_k=cumsum(lengths), max_seqlen_q=max(q_lens),
                       max_seqlen_k=max(lengths), context_lens=int32(lengths),
                       block_tables=int32([t + [-1] * (width - len(t)) for t in tables]))

    def reference(self, q: torch.Tensor, name: str, length: int, window: int = 0,
                  softcap: float = 0.0) -> torch.Tensor:
        """Float64 causal attention of q (the last q.size(0) positions of `length`) over the cached K/V, each query
        seeing the last `window` positions up to itself, scores capped by softcap * tanh(score / softcap)."""
        k, v = (c[self.tables[name]].flatten(0, 1)[:length].double() for c in (self.k, self.v))
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        positions = torch.arange(length, device=DEVICE)
        allowed = positions[None] <= positions[length - q.size(0):, None]
        if window:
            allowed &= positions[None] > positions[length - q.size(0):, None] - window
        return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


# (name, context length, new query rows): a whole prefill, a chunk over a cached prefix of two blocks,
# a one-token chunk at a block edge and a short prompt.
PREFILL = [("a", 300, 300), ("b", 600, 88), ("c", 257, 1), ("d", 20, 20)]
# decodes across block edges, and a long one
DECODE = [("a", 1, 1), ("b", 255, 1), ("c", 256, 1), ("d", 257, 1), ("e", 1000, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("steps", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("name", BACKENDS)
def test_attention_equals_a_float64_reference(name, steps, dtype):
    backend = require_backend(name, dtype, BLOCK, HEAD_DIM)
    cache = PagedCache(dtype)
    ctx = cache.context(steps)
    q = rand(sum(n for _, _, n in steps), HEADS, HEAD_DIM, dtype=dtype)
    out = backend.attend(q, cache.k, cache.v, ctx, SCALE)
    rows = ctx.cu_seqlens_q.tolist()
    for i, (seq, length, _) in enumerate(steps):
        expected = cache.reference(q[rows[i]:rows[i + 1]], seq, length)
        torch.testing.assert_close(out[rows[i]:rows[i + 1]].double(), expected, atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("window, softcap", [(300, 0.0), (0, 30.0), (100, 30.0)])
@pytest.mark.parametrize("steps", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("name", BACKENDS)
def test_sliding_window_and_capped_scores_equal_a_float64_reference(name, steps, window, softcap):
    """Every backend (flash-attn through `window_size` and `softcap`), with the blocks wholly before each sequence's
    window released as the block manager leaves them (-1 in the table)."""
    dtype = torch.bfloat16
    backend = require_backend(name, dtype, BLOCK, HEAD_DIM)
    cache = PagedCache(dtype, seed=2)
    ctx = cache.context(steps)
    for i, (_, length, n) in enumerate(steps):
        ctx.block_tables[i, :max(0, length - n - window + 1) // BLOCK if window else 0] = -1
    q = rand(sum(n for _, _, n in steps), HEADS, HEAD_DIM, dtype=dtype)
    out = backend.attend(q, cache.k, cache.v, ctx, SCALE, window=window, softcap=softcap)
    rows = ctx.cu_seqlens_q.tolist()
    for i, (seq, length, _) in enumerate(steps):
        expected = cache.reference(q[rows[i]:rows[i + 1]], seq, length, window, softcap)
        torch.testing.assert_close(out[rows[i]:rows[i + 1]].double(), expected, atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", BACKENDS)
def test_attention_rows_do_not_depend_on_cache_hits_or_the_batch(name, dtype):
    """The rows of sequence "s" (600 tokens) come out bit-identical: its whole prefill alone; its last 88 rows
    as a chunk over its cached prefix, after another sequence's prefill; its decode alone, among other
    decodes, and followed by graph padding rows (context length 0)."""
    backend = require_backend(name, dtype, BLOCK, HEAD_DIM)
    cache = PagedCache(dtype, seed=1)
    q = rand(600, HEADS, HEAD_DIM, dtype=dtype)
    whole = backend.attend(q, cache.k, cache.v, cache.context([("s", 600, 600)]), SCALE)
    other = rand(300, HEADS, HEAD_DIM, dtype=dtype)
    chunk = backend.attend(torch.cat([other, q[512:]]), cache.k, cache.v,
                           cache.context([("t", 300, 300), ("s", 600, 88)]), SCALE)
    assert torch.equal(chunk[300:], whole[512:])

    step = rand(5, HEADS, HEAD_DIM, dtype=dtype)  # row 4 is "s"'s decode query
    alone = backend.attend(step[4:], cache.k, cache.v, cache.context([("s", 600, 1)]), SCALE)
    batched = backend.attend(step, cache.k, cache.v,
                             cache.context([("t", 1, 1), ("u", 1000, 1), ("v", 257, 1), ("t", 300, 1), ("s", 600, 1)]),
                             SCALE)
    assert torch.equal(batched[4], alone[0])
    if backend.capturable:  # CUDA graphs pad a decode batch with rows of context length 0
        padded = cache.context([("s", 600, 1), ("t", 300, 1)])
        padded.context_lens[1], padded.block_tables[1] = 0, -1
        assert torch.equal(backend.attend(step[[4, 0]], cache.k, cache.v, padded, SCALE)[0], alone[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_triton_store_equals_torch_store(dtype):
    pytest.importorskip("triton")
    from nanovllm.kernels.attention.triton_kv import store_kvcache

    torch.manual_seed(3)
    qkv = rand(9, 3 * KV_HEADS * HEAD_DIM, dtype=dtype)
    k, v = (t.view(9, KV_HEADS, HEAD_DIM) for t in qkv.split(KV_HEADS * HEAD_DIM, -1)[1:])
    slots = torch.tensor([17, -1, 3, 0, 1000, -1, 8, 512, 4], device=DEVICE)
    ref = rand(2, 4, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    out = ref.clone()
    TorchBackend.store_kvcache(k, v, ref[0], ref[1], slots)
    store_kvcache(k, v, out[0], out[1], slots)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("batch_size", [1, 3, 17, 100])
@pytest.mark.parametrize("name", BACKENDS)
def test_graph_replay_equals_eager_decode(gpu_model, name, dtype, batch_size):
    backend = require_backend(name, getattr(torch, dtype), BLOCK, 64)
    if not backend.capturable:
        pytest.skip(f"{backend.name} decode is not captured in CUDA graphs")
    rng = random.Random(batch_size)
    with LLM(gpu_model, dtype=dtype, attention_backend=name, max_num_seqs=128, enforce_eager=False) as llm:
        runner = llm.engine.model_runner
        assert pick_batch_size(runner.graphs.sizes, batch_size) >= batch_size
        for _ in range(batch_size):
            llm.add_request([rng.randrange(384) for _ in range(rng.randint(1, 400))], GREEDY)
        batch = llm.engine.scheduler.schedule()
        while batch.num_decode_tokens < len(batch):  # until every request has its prompt computed
            for seq, (token,) in llm.engine.scheduler.new_tokens(batch, runner.run(batch).token_ids):
                seq.append_token(token)
            batch = llm.engine.scheduler.schedule()
        assert len(batch) == batch_size
        input_ids, positions, _ = runner.prepare(batch)
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
        config, num_blocks = llm.config, llm.engine.model_runner.kv_cache.num_blocks
        cap = config.max_num_seqs * config.blocks_per_sequence
        assert config.blocks_per_sequence <= num_blocks < cap
        assert num_blocks * kv_block_bytes(config) <= headroom
        used = total - torch.cuda.mem_get_info()[1]
        assert used <= utilization * total + 256 * 2**20  # CUDA graphs' pool and library workspaces


def test_too_little_gpu_memory_is_a_clear_error(gpu_model):
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = (total - free + 2**20) / total
    with pytest.raises(ValueError, match="the KV cache holds 0 blocks .*gpu_memory_utilization"):
        LLM(gpu_model, dtype="bfloat16", gpu_memory_utilization=utilization)
