from types import SimpleNamespace

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, num_kvcache_blocks=num_blocks, kvcache_block_size=BS)
    return Scheduler(config, eos_token_ids={0})


def seq(seq_id: int, n: int, max_tokens: int = 64, ignore_eos: bool = True) -> Sequence:
    return Sequence(seq_id, [seq_id * 100 + i + 1 for i in range(n)], BS,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def test_prefill_first_then_decode():
    s = make_scheduler()
    a, b = seq(1, 5), seq(2, 6)
    s.add(a)
    batch, is_prefill = s.schedule()
    assert batch == [a] and is_prefill
    s.postprocess(batch, [7])
    s.add(b)
    batch, is_prefill = s.schedule()
    assert batch == [b] and is_prefill, "a waiting request is admitted before running ones decode"
    s.postprocess(batch, [7])
    batch, is_prefill = s.schedule()
    assert batch == [a, b] and not is_prefill


def test_token_budget_and_max_num_seqs_limit_prefill():
    s = make_scheduler(max_num_batched_tokens=20)
    for i in range(1, 4):
        s.add(seq(i, 8))
    batch, _ = s.schedule()
    assert [x.seq_id for x in batch] == [1, 2]
    s = make_scheduler(max_num_seqs=2)
    for i in range(1, 4):
        s.add(seq(i, 2))
    batch, _ = s.schedule()
    assert len(batch) == 2 and len(s.waiting) == 1


def test_free_blocks_limit_prefill():
    s = make_scheduler(num_blocks=3)
    s.add(seq(1, 8))
    s.add(seq(2, 8))
    batch, _ = s.schedule()
    assert [x.seq_id for x in batch] == [1]


def test_decode_preempts_youngest_and_puts_it_first_in_waiting():
    s = make_scheduler(num_blocks=3)
    a, b, c = seq(1, 4), seq(2, 4), seq(3, 4)
    for x in (a, b, c):
        s.add(x)
    batch, _ = s.schedule()
    assert batch == [a, b, c]
    s.postprocess(batch, [9, 9, 9])  # each now needs a second block; none is free
    batch, is_prefill = s.schedule()
    assert not is_prefill
    assert batch == [a]
    assert list(s.waiting) == [b, c], "victims are taken from the back and pushed to the front"
    assert b.status == c.status == SequenceStatus.WAITING and not b.block_table and not c.block_table
    assert s.num_preemptions == 2


def test_finish_rules_free_blocks():
    s = make_scheduler(max_model_len=8)
    by_eos, by_max_tokens, by_length = seq(1, 2, ignore_eos=False), seq(2, 2, max_tokens=1), seq(3, 7)
    for x in (by_eos, by_max_tokens, by_length):
        s.add(x)
    batch, _ = s.schedule()
    s.postprocess(batch, [0, 5, 5])
    assert all(x.is_finished for x in batch)
    assert s.is_finished()
    assert s.block_manager.num_free_blocks == 16


def test_abort_all_frees_everything():
    s = make_scheduler()
    for i in range(1, 4):
        s.add(seq(i, 5))
    s.schedule()
    s.add(seq(9, 3))
    s.abort_all()
    assert s.is_finished() and s.block_manager.num_free_blocks == 16
