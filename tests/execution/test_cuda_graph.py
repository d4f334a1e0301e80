"""CUDA-graph decode bookkeeping (batch-size buckets, padding into static buffers, the price of a verify step that no
graph replays), tested on CPU."""
import math

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence
from nanovllm.execution.cuda_graph import DecodeBuffers, VerifyPrice, graph_batch_sizes, pick_batch_size, verifies
from nanovllm.kernels.attention.context import Context, get_context, reset_context


@pytest.mark.parametrize("max_num_seqs, expected", [
    (1, [1]),
    (3, [1, 2, 3]),
    (8, [1, 2, 4, 8]),
    (16, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 20]),
    (100, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]),
    (512, [1, 2, 4, 8] + list(range(16, 513, 16))),
    (4096, [1, 2, 4, 8] + list(range(16, 513, 16))),
])
def test_graph_batch_sizes(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


@pytest.mark.parametrize("max_num_seqs", [1, 7, 100, 512, 1000])
def test_pick_batch_size_is_the_smallest_bucket_that_fits(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    for batch in range(1, sizes[-1] + 1):
        assert pick_batch_size(sizes, batch) == min(s for s in sizes if s >= batch)
    assert pick_batch_size(sizes, sizes[-1] + 1) is None


def decode_context(slots: list[int], lens: list[int], tables: list[list[int]]) -> Context:
    return Context(cu_seqlens_q=torch.arange(len(slots) + 1, dtype=torch.int32), max_seqlen_q=1,
                   slot_mapping=torch.tensor(slots), context_lens=torch.tensor(lens, dtype=torch.int32),
                   block_tables=torch.tensor(tables, dtype=torch.int32))


def test_load_pads_rows_and_clears_stale_ones():
    b = DecodeBuffers.allocate(8, 4, max_seqlen_k=16, hidden_size=6, dtype=torch.float32, device=torch.device("cpu"))
    b.load(torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12]),
           decode_context([40, 41, 9], [11, 12, 13], [[10, 11, 12], [3, 4, -1], [2, -1, -1]]))
    b.load(torch.tensor([8]), torch.tensor([3]), decode_context([2], [4], [[7]]))
    assert b.input_ids[0] == 8 and b.positions[0] == 3
    assert b.slot_mapping.tolist() == [2] + [-1] * 7
    assert b.context_lens.tolist() == [4] + [0] * 7
    assert b.block_tables.tolist() == [[7, -1, -1, -1]] + [[-1] * 4] * 7


def test_set_context_views_the_buffers():
    b = DecodeBuffers.allocate(8, 4, max_seqlen_k=16, hidden_size=6, dtype=torch.float32, device=torch.device("cpu"))
    try:
        b.set_context(4)
        ctx = get_context()
        assert ctx.is_decode and ctx.max_seqlen_k == 16 and ctx.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
        for name in ("slot_mapping", "context_lens", "block_tables"):
            view, buffer = getattr(ctx, name), getattr(b, name)
            assert view.size(0) == 4 and view.data_ptr() == buffer.data_ptr()
    finally:
        reset_context()


def test_padded_decode_equals_unpadded_decode(tied_model):
    """What a graph replays (the batch padded to its bucket in the static buffers) gives the same hidden
    states for the real rows as the eager forward, and the padding rows write nothing to the KV cache."""
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=4, max_model_len=64, max_num_seqs=8) as llm:
        runner = llm.engine.model_runner
        prompts = [[1, 2, 3, 4, 5], [9] * 11, [7, 8]]
        for prompt in prompts:
            llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
        llm.step()
        batch = llm.engine.scheduler.schedule()
        seqs = batch.seqs
        assert batch.num_decode_tokens == 3 and len(set(len(seq.block_table) for seq in seqs)) > 1
        sizes = graph_batch_sizes(runner.config.max_num_seqs)
        size = pick_batch_size(sizes, len(seqs))
        assert size == 4
        buffers = DecodeBuffers.allocate(sizes[-1], 16, 64, runner.config.hf_config.hidden_size, torch.float32,
                                         torch.device("cpu"))
        before = runner.kv_cache.tensor.clone()
        input_ids, positions, _ = runner.prepare(batch)
        ctx = get_context()
        with torch.inference_mode():
            stale = torch.arange(sizes[-1])  # a previous, larger batch whose slots the padding must not reuse
            buffers.load(stale, stale, decode_context(stale.tolist(), [1] * sizes[-1], [[0]] * sizes[-1]))
            buffers.load(input_ids, positions, ctx)
            buffers.forward(runner.model, size)
            padded = buffers.hidden_states[:len(seqs)].clone()
            written = (runner.kv_cache.tensor != before).flatten(4).any(-1)  # [k/v, layer, block, offset]
            expected = torch.zeros_like(written)
            for slot in ctx.slot_mapping.tolist():
                expected[:, :, slot // 4, slot % 4] = True
            assert torch.equal(written, expected)
            reset_context()
            runner.prepare(batch)
            eager = runner.model(input_ids, positions)
        reset_context()
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        assert torch.equal(runner.model.compute_logits(padded).argmax(-1),
                           runner.model.compute_logits(eager).argmax(-1))


def decoding(num_seqs: int, drafts: int = 0) -> tuple[list[Sequence], ScheduledBatch]:
    """`num_seqs` sequences about to decode (with `drafts` drafts each), and the step that runs them."""
    seqs = [Sequence(i, [1, 2, 3], 16, SamplingParams()) for i in range(num_seqs)]
    batch = ScheduledBatch()
    for seq in seqs:
        seq.num_computed_tokens = 2
        seq.spec_token_ids = [5] * drafts
        batch.add(seq, 1 + drafts, seq.spec_token_ids)
        seq.num_computed_tokens = 2
    return seqs, batch


def test_a_verify_step_is_priced_against_the_graph_replays_of_its_size_class():
    price = VerifyPrice(max_graph_batch=8)
    seqs, plain = decoding(2)
    _, verify = decoding(2, drafts=3)
    assert verifies(verify) and not verifies(plain)
    assert price(seqs) == math.inf  # no replay of 2-3 sequences timed: the next step replays one
    price.observe(plain, replayed=True, seconds=0.010)
    assert price(seqs) == 1.0  # the prior: speculate, and time it
    price.observe(verify, replayed=False, seconds=0.030)
    assert price(seqs) == pytest.approx(0.99 * 3.0 + 0.01)
    assert price(decoding(3)[0]) == pytest.approx(0.99 * (0.99 * 3.0 + 0.01) + 0.01)  # 3 is in 2's class
    assert price(decoding(4)[0]) == math.inf  # 4-7 is another class
    prompt, _ = decoding(2)
    prompt[1].num_computed_tokens = 0
    assert price(prompt) == 1.0  # a prompt's chunk in the step: it runs eagerly anyway
    assert price(decoding(9)[0]) == 1.0  # larger than every graph: eager anyway
    for _ in range(200):  # a class found too costly is tried again: its figure drifts back to the prior
        last = price(seqs)
    assert 1.0 < last < 1.3


def test_only_verify_steps_that_graphs_could_have_run_are_priced():
    price = VerifyPrice(max_graph_batch=8)
    _, plain = decoding(2)
    price.observe(plain, replayed=True, seconds=0.010)
    price.observe(plain, replayed=True, seconds=0.020)
    assert price.replay_seconds[2] == pytest.approx(0.7 * 0.010 + 0.3 * 0.020)
    _, chunked = decoding(2, drafts=3)
    chunked.num_tokens[0] += 4  # a chunk of a prompt beside drafts: not a verify step
    assert not verifies(chunked)
    price.observe(chunked, replayed=False, seconds=1.0)
    price.observe(decoding(8)[1], replayed=True, seconds=0.010)
    _, large = decoding(9, drafts=3)  # in 8's class, but larger than every graph
    price.observe(large, replayed=False, seconds=1.0)
    seqs, _ = decoding(2)
    assert price(seqs) == 1.0 and not price.ratios.ratios
