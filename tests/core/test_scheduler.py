"""The scheduler alone (no model): one token budget per step, chunked prefill, mixed steps, preemption,
priorities, aborts and finish reasons, as vLLM V1 schedules."""
import random

import pytest

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.core.stopping import token_finish
from nanovllm.sampling_params import SamplingParams

BS = 4
EOS = {0}


class EngineSideScheduler(Scheduler):
    """The scheduler, plus what the engine does with a step's sampled tokens."""

    def __init__(self, config: SchedulerConfig, max_model_len: int):
        super().__init__(config)
        self.max_model_len = max_model_len

    def take(self, batch: ScheduledBatch, tokens: list[int]) -> list[Sequence]:
        """Append the sampled tokens, then end the sequences `token_finish` ends."""
        sampled = []
        for x, (token,) in self.new_tokens(batch, tokens):
            x.append_token(token)
            ending = token_finish(x, EOS, self.max_model_len)
            if ending is not None:
                self.finish(x, *ending)
            sampled.append(x)
        return sampled


def make_scheduler(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, chunked=True,
                   policy="fcfs") -> EngineSideScheduler:
    return EngineSideScheduler(SchedulerConfig(num_kv_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs,
                                               max_num_batched_tokens=max_num_batched_tokens,
                                               enable_chunked_prefill=chunked, scheduling_policy=policy),
                               max_model_len)


def seq(seq_id: int, n: int, max_tokens: int = 64, ignore_eos: bool = True, priority: int = 0,
        tokens: list[int] | None = None) -> Sequence:
    tokens = tokens or [seq_id * 100 + i + 1 for i in range(n)]
    return Sequence(seq_id, tokens, BS, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), priority)


def run_step(s: Scheduler, token: int = 7) -> ScheduledBatch:
    """Schedule one step and feed back `token` for every sequence that samples."""
    batch = s.schedule()
    s.take(batch, [token] * sum(batch.samples))
    return batch


def plan(batch: ScheduledBatch) -> list[tuple[int, int, int]]:
    return list(zip([x.seq_id for x in batch.seqs], batch.starts, batch.num_tokens))


def all_blocks_free(s: Scheduler) -> bool:
    bm = s.block_manager
    return bm.num_free_blocks == len(bm.blocks)


def test_long_prompt_runs_in_chunks_and_samples_only_at_its_end():
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    a = seq(1, 20)
    s.add(a)
    assert plan(batch := run_step(s)) == [(1, 0, 8)] and batch.samples == [False]
    assert plan(batch := run_step(s)) == [(1, 8, 8)] and batch.samples == [False]
    assert plan(batch := run_step(s)) == [(1, 16, 4)] and batch.samples == [True]
    assert len(a) == 21 and a.num_computed_tokens == 20
    assert plan(run_step(s)) == [(1, 20, 1)]
    assert s.num_chunked_steps == 2


def test_decodes_go_first_and_a_waiting_prompt_fills_the_rest_of_the_budget():
    s = make_scheduler(max_num_batched_tokens=10, max_num_seqs=4)
    a, b = seq(1, 3), seq(2, 3)
    s.add(a)
    s.add(b)
    assert plan(run_step(s)) == [(1, 0, 3), (2, 0, 3)]
    c = seq(3, 30)
    s.add(c)
    batch = run_step(s)
    assert plan(batch) == [(1, 3, 1), (2, 3, 1), (3, 0, 8)], "decodes, then a chunk of what the budget leaves"
    assert batch.num_decode_tokens == 2 and batch.num_prefill_tokens == 8
    assert s.num_mixed_steps == 1


def test_a_decode_advances_every_step_while_a_long_prompt_is_prefilled():
    s = make_scheduler(max_num_batched_tokens=6, max_num_seqs=4, num_blocks=32)
    s.add(short := seq(1, 2))
    run_step(s)
    s.add(long := seq(2, 40))
    while long.num_computed_tokens < 40:
        before = len(short)
        assert plan(run_step(s))[0] == (1, before - 1, 1)
        assert len(short) == before + 1
    assert long.num_completion_tokens == 1


def test_budget_and_blocks_are_never_exceeded_and_everything_finishes_exactly():
    rng = random.Random(0)
    for chunked, budget in ((True, 16), (False, 40)):
        s = make_scheduler(num_blocks=24, max_num_seqs=5, max_num_batched_tokens=budget, max_model_len=40,
                           chunked=chunked)
        seqs = [seq(i, rng.randint(1, 35), max_tokens=rng.randint(1, 12)) for i in range(1, 30)]
        pending = list(seqs)
        steps = 0
        while pending or not s.is_finished():
            while pending and rng.random() < 0.5:
                s.add(pending.pop(0))
            decoding = [x for x in s.running if len(x) - x.num_computed_tokens == 1]
            batch = run_step(s)
            steps += 1
            assert not chunked or all(x in batch.seqs or x.status == SequenceStatus.PREEMPTED for x in decoding), \
                "a running decode is never left out of a step"
            preemptions = s.num_preemptions
            assert sum(batch.num_tokens) <= budget and len(batch) <= 5
            assert len(set(batch.seqs)) == len(batch)
            assert s.block_manager.num_free_blocks >= 0
            if not chunked:
                assert all(batch.samples), "without chunked prefill every prompt runs whole"
            assert steps < 2000
        assert preemptions and (s.num_chunked_steps or not chunked), "the workload exercises what it tests"
        for x in seqs:
            assert x.finish_reason == "length"
            assert x.num_completion_tokens == min(x.params.max_tokens, 40 - x.num_prompt_tokens)
        assert all_blocks_free(s)


def test_prefill_first_mode_is_nano_vllms():
    s = make_scheduler(chunked=False)
    a, b = seq(1, 5), seq(2, 6)
    s.add(a)
    assert plan(run_step(s)) == [(1, 0, 5)]
    s.add(b)
    assert plan(run_step(s)) == [(2, 0, 6)], "a waiting request is admitted before running ones decode"
    assert plan(run_step(s)) == [(1, 5, 1), (2, 6, 1)]
    assert s.num_mixed_steps == 0 and s.num_chunked_steps == 0


def test_token_budget_and_max_num_seqs_limit_admission():
    s = make_scheduler(max_num_batched_tokens=20, chunked=False)
    for i in range(1, 4):
        s.add(seq(i, 8))
    assert [x.seq_id for x in s.schedule().seqs] == [1, 2]
    s = make_scheduler(max_num_seqs=2)
    for i in range(1, 4):
        s.add(seq(i, 2))
    assert len(s.schedule()) == 2 and len(s.waiting) == 1


def test_free_blocks_limit_admission():
    s = make_scheduler(num_blocks=3)
    s.add(seq(1, 8))
    s.add(seq(2, 8))
    assert [x.seq_id for x in s.schedule().seqs] == [1]


def test_a_request_that_can_never_fit_is_refused_at_once():
    s = make_scheduler(num_blocks=3)
    with pytest.raises(ValueError, match="needs 4 KV blocks .* the cache has 3"):
        s.add(seq(1, 13))
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, chunked=False)
    with pytest.raises(ValueError, match="more than max_num_batched_tokens=8, and chunked prefill is off"):
        s.add(seq(1, 9))
    assert s.is_finished()


def test_preemption_takes_the_youngest_and_it_resumes_before_later_arrivals():
    s = make_scheduler(num_blocks=3)
    a, b, c = seq(1, 4), seq(2, 4), seq(3, 4)
    for x in (a, b, c):
        s.add(x)
    assert len(run_step(s)) == 3  # each now needs a second block; none is free
    batch = s.schedule()
    assert batch.seqs == [a]
    assert list(s.waiting) == [b, c]
    assert b.status == c.status == SequenceStatus.PREEMPTED and not b.block_table and not c.block_table
    assert b.num_computed_tokens == 0 and len(b) == 5, "its sampled token is kept and recomputed"
    assert s.num_preemptions == 2
    s.take(batch, [7])
    s.add(d := seq(4, 2))
    assert list(s.waiting) == [b, c, d]


def test_preempting_a_sequence_mid_prefill_resets_it_and_frees_its_blocks():
    s = make_scheduler(num_blocks=10, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=40)
    a = seq(1, 4)
    s.add(a)
    run_step(s)
    b = seq(2, 30)
    s.add(b)
    while b.num_computed_tokens < 12:
        run_step(s)
    assert b.status == SequenceStatus.RUNNING and 0 < b.num_computed_tokens < 30
    while b.status != SequenceStatus.PREEMPTED:  # a keeps decoding until the cache runs out
        run_step(s)
    assert b.num_computed_tokens == 0 and not b.block_table
    while not s.is_finished():
        run_step(s)
    assert all_blocks_free(s)


def test_priority_order_admission_and_preemption():
    s = make_scheduler(num_blocks=3, max_num_seqs=2, policy="priority")
    low, high, mid = seq(1, 4, priority=5), seq(2, 4, priority=-1), seq(3, 4, priority=2)
    for x in (low, high, mid):
        s.add(x)
    assert [x.seq_id for x in s.waiting] == [2, 3, 1]
    assert [x.seq_id for x in run_step(s).seqs] == [2, 3], "lower value runs first"
    batch = s.schedule()  # both need a second block, one is free: the lower priority one yields
    assert batch.seqs == [high] and mid.status == SequenceStatus.PREEMPTED
    assert [x.seq_id for x in s.waiting] == [3, 1], "and waits ahead of lower priorities"


def test_priority_preemption_takes_back_a_sequence_already_scheduled_this_step():
    s = make_scheduler(num_blocks=3, max_num_seqs=3, policy="priority")
    low = seq(1, 6, priority=9)
    s.add(low)
    run_step(s)
    s.add(high := seq(2, 4, priority=0))
    run_step(s)
    assert s.running == [low, high] and s.block_manager.num_free_blocks == 0
    batch = s.schedule()
    # low decodes first (running order) and fits; high then needs a block, so low is taken back.
    assert batch.seqs == [high] and batch.num_tokens == [1]
    assert low.status == SequenceStatus.PREEMPTED and not low.block_table
    first_block = BlockManager.compute_hash(low.block(0))
    assert first_block in s.block_manager.hash_to_block_id, "its computed block stays in the prefix cache"


def test_finish_reasons_free_blocks():
    s = make_scheduler(max_model_len=8)
    by_eos, by_max_tokens, by_length = seq(1, 2, ignore_eos=False), seq(2, 2, max_tokens=1), seq(3, 7)
    for x in (by_eos, by_max_tokens, by_length):
        s.add(x)
    batch = s.schedule()
    sampled = s.take(batch, [0, 5, 5])
    assert sampled == [by_eos, by_max_tokens, by_length]
    assert [x.finish_reason for x in sampled] == ["stop", "length", "length"]
    assert s.is_finished() and all_blocks_free(s)


@pytest.mark.parametrize("where", ["waiting", "running", "preempted"])
def test_abort_frees_every_block_wherever_the_request_is(where):
    s = make_scheduler(num_blocks=3)
    a, b = seq(1, 4), seq(2, 4)
    s.add(a)
    s.add(b)
    if where != "waiting":
        run_step(s)
    if where == "preempted":
        s.take(s.schedule(), [7])
        assert b.status == SequenceStatus.PREEMPTED
    s.abort(b.seq_id)
    assert b.finish_reason == "abort" and b.is_finished and not b.block_table
    assert b not in s.running and b not in list(s.waiting)
    s.abort(b.seq_id)  # already finished: nothing happens
    s.abort(a.seq_id)
    assert s.is_finished() and all_blocks_free(s)


def test_abort_all_after_a_failed_step_forgets_blocks_that_were_never_computed():
    s = make_scheduler()
    a = seq(1, 9, tokens=list(range(1, 10)))
    s.add(a)
    s.schedule()  # the step "fails": its K/V were never written
    s.add(seq(9, 3))
    s.abort_all()
    assert s.is_finished() and all_blocks_free(s)
    again = seq(2, 9, tokens=list(range(1, 10)))
    s.add(again)
    s.schedule()
    assert s.num_cached_tokens == 0, "a prefix that was never computed is not a cache hit"


def test_a_prefix_being_prefilled_is_shared_with_a_later_request():
    s = make_scheduler(max_num_batched_tokens=10, max_num_seqs=4, num_blocks=32)
    prompt = list(range(1, 25))
    a = seq(1, 0, tokens=prompt)
    s.add(a)
    run_step(s)
    s.add(b := seq(2, 0, tokens=prompt + [99]))
    assert plan(run_step(s)) == [(1, 10, 10)], "the budget went to a's chunk"
    # a's last chunk fills block 5 in this very step; b, admitted after it, shares all six blocks.
    assert plan(run_step(s)) == [(1, 20, 4), (2, 24, 1)]
    assert b.block_table[:6] == a.block_table[:6] and s.num_cached_tokens == 24


def beam(seq_id: int, n: int) -> Sequence:
    x = seq(seq_id, n)
    x.search = object()  # a beam search's: the engine hands its sampled tokens to the search instead of appending
    return x


def hold(s: Scheduler, batch: ScheduledBatch) -> list[Sequence]:
    """What the engine and a beam search do with a step's beams: each that sampled waits, its token not appended."""
    sampled = [x for x, _ in s.new_tokens(batch, [7] * sum(batch.samples))]
    for x in sampled:
        x.held = True
    return sampled


def test_held_beams_are_not_run_and_forks_share_their_blocks():
    s = make_scheduler(num_blocks=16)
    s.add(a := beam(1, 6))
    assert hold(s, s.schedule()) == [a]
    assert not s.schedule(), "a held beam is not run"
    b, copies = s.fork(a, 2)
    assert b.status == SequenceStatus.RUNNING and b in s.running and b.search is a.search
    assert copies == [(a.block_table[1], b.block_table[1], 2)] and b.block_table[0] == a.block_table[0]
    a.append_token(8)
    b.append_token(9)
    a.held = b.held = False
    assert plan(s.schedule()) == [(1, 6, 1), (2, 6, 1)], "both decode: nothing is computed again"
    for x in (a, b):
        s.finish(x, "stop")
    assert all_blocks_free(s)


def test_a_fork_waits_without_room_and_its_full_blocks_come_from_the_prefix_cache():
    s = make_scheduler(num_blocks=16, max_num_seqs=1)
    s.add(a := beam(1, 9))
    hold(s, s.schedule())
    b, copies = s.fork(a, 2)
    assert copies == [] and b.status == SequenceStatus.WAITING and not b.block_table and b.num_computed_tokens == 0
    for x, token in ((a, 8), (b, 9)):
        x.append_token(token)
        x.held = False
    assert plan(s.schedule()) == [(1, 9, 1)]
    s.finish(a, "stop")  # a's blocks are freed, their names kept
    assert plan(s.schedule()) == [(2, 8, 2)], "its two full blocks hit the cache"
    s.finish(b, "stop")
    assert all_blocks_free(s)


def test_held_beams_are_preempted_when_the_beams_they_wait_for_cannot_get_in():
    s = make_scheduler(num_blocks=4, max_num_seqs=8)
    s.add(a := beam(1, 7))
    s.add(b := beam(2, 7))
    hold(s, s.schedule())  # both sampled and wait; a third beam, waiting, needs 2 blocks and none is free
    s.add(c := beam(3, 7))
    batch = s.schedule()
    assert b.status == SequenceStatus.PREEMPTED and b.held and not b.block_table
    assert plan(batch) == [(3, 0, 7)], "c got b's blocks"
    assert list(s.waiting) == [b], "a held beam waits to be admitted until its search releases it"
    hold(s, batch)
    assert not s.schedule()
    b.append_token(8)
    b.held = False
    for x in (a, c):
        s.finish(x, "stop")
    assert plan(s.schedule()) == [(2, 0, 8)], "b is computed again, with the token its search gave it"
    s.finish(b, "stop")
    assert all_blocks_free(s)
