import pytest

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 4


def seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, tokens, BS, SamplingParams())


def admit(bm: BlockManager, s: Sequence, num_tokens: int | None = None) -> int:
    """Allocate `s` as the scheduler admits it: after its cached prefix, `num_tokens` more (default: all).
    Returns the number of cached tokens."""
    cached = bm.cached_prefix(s)
    num_cached = len(cached) * BS
    num_tokens = len(s) - num_cached if num_tokens is None else num_tokens
    assert bm.allocate(s, num_tokens, cached)
    s.num_computed_tokens = num_cached + num_tokens
    return num_cached


def test_hash_chains_over_prefix():
    a = BlockManager.compute_hash([1, 2, 3, 4])
    assert a == BlockManager.compute_hash([1, 2, 3, 4])
    assert BlockManager.compute_hash([5, 6, 7, 8], a) != BlockManager.compute_hash([5, 6, 7, 8])
    assert BlockManager.compute_hash([5, 6, 7, 8], a) != BlockManager.compute_hash([5, 6, 7, 8], a + 1)


def test_allocate_shares_full_prefix_blocks_with_ref_counts():
    bm = BlockManager(8, BS)
    s1, s2 = seq(list(range(10)), 1), seq(list(range(8)) + [99, 98, 97], 2)
    assert admit(bm, s1) == 0 and len(s1.block_table) == 3
    assert admit(bm, s2) == 8
    assert s2.block_table[:2] == s1.block_table[:2] and s2.block_table[2] != s1.block_table[2]
    assert [bm.blocks[b].ref_count for b in s1.block_table] == [2, 2, 1]
    bm.deallocate(s1)
    assert [bm.blocks[b].ref_count for b in s2.block_table] == [1, 1, 1]
    bm.deallocate(s2)
    assert bm.num_free_blocks == 8 and all(block.ref_count == 0 for block in bm.blocks)


def test_different_prefix_same_block_content_misses():
    bm = BlockManager(8, BS)
    s1 = seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    s2 = seq([9, 9, 9, 9, 5, 6, 7, 8, 0])
    admit(bm, s1)
    assert admit(bm, s2) == 0
    assert set(s1.block_table).isdisjoint(s2.block_table)


def test_hit_after_free_until_block_is_reused():
    bm = BlockManager(4, BS)
    s1 = seq(list(range(9)))
    admit(bm, s1)
    cached = s1.block_table[:2]
    bm.deallocate(s1)
    s2 = seq(list(range(9)), 2)
    assert admit(bm, s2) == 8 and s2.block_table[:2] == cached
    bm.deallocate(s2)
    # Fill the cache with other content: the old blocks get reused and their hashes forgotten.
    filler = seq([100 + i for i in range(16)], 3)
    admit(bm, filler)
    bm.deallocate(filler)
    assert admit(bm, seq(list(range(9)), 4)) == 0


def test_hash_collision_is_confirmed_against_token_ids():
    bm = BlockManager(4, BS)
    s1 = seq([1, 2, 3, 4, 5])
    admit(bm, s1)
    h = bm.blocks[s1.block_table[0]].hash
    bm.blocks[s1.block_table[0]].token_ids = [7, 7, 7, 7]  # pretend a different block had this hash
    assert bm.hash_to_block_id[h] == s1.block_table[0]
    assert admit(bm, seq([1, 2, 3, 4, 5], 2)) == 0


def test_whole_prompt_hit_recomputes_last_block():
    bm = BlockManager(8, BS)
    s1 = seq(list(range(8)))
    admit(bm, s1)
    s2 = seq(list(range(8)), 2)
    assert admit(bm, s2) == 4  # the block holding the last token is computed, not shared
    assert s2.block_table[0] == s1.block_table[0] and s2.block_table[1] != s1.block_table[1]


def test_chunks_get_blocks_as_they_go_and_name_only_filled_blocks():
    bm = BlockManager(8, BS)
    s = seq(list(range(10)))
    admit(bm, s, 3)
    assert len(s.block_table) == 1 and bm.blocks[s.block_table[0]].hash == -1
    assert bm.allocate(s, 3)  # tokens 3..5: fills block 0, starts block 1
    s.num_computed_tokens = 6
    assert len(s.block_table) == 2
    assert bm.blocks[s.block_table[0]].hash == BlockManager.compute_hash([0, 1, 2, 3])
    assert bm.blocks[s.block_table[1]].hash == -1
    other = seq(list(range(4)) + [50, 51], 1)
    assert admit(bm, other) == 4, "a prefix still being prefilled by another request is a hit once computed"


@pytest.mark.parametrize("block_size", [1, 4])
def test_decode_gets_a_block_at_the_boundary_and_refuses_when_none_is_free(block_size):
    bm = BlockManager(3, block_size)
    s = Sequence(0, list(range(block_size)), block_size, SamplingParams())
    assert bm.allocate(s, block_size)
    s.num_computed_tokens = block_size
    assert len(s.block_table) == 1
    s.append_token(42)  # its KV goes into a new block
    assert bm.allocate(s, 1)
    s.num_computed_tokens += 1
    assert len(s.block_table) == 2
    while len(s) < 2 * block_size:
        s.append_token(43)
        assert bm.allocate(s, 1)
        s.num_computed_tokens += 1
    assert len(s.block_table) == 2
    last = bm.blocks[s.block_table[-1]]
    assert last.hash == BlockManager.compute_hash(s.block(1), bm.blocks[s.block_table[0]].hash)
    other = Sequence(1, [500], block_size, SamplingParams())
    assert bm.allocate(other, 1)
    assert bm.num_free_blocks == 0
    s.append_token(44)
    table = list(s.block_table)
    assert not bm.allocate(s, 1) and s.block_table == table


def test_decode_hashes_full_blocks_for_later_hits():
    bm = BlockManager(8, BS)
    s1 = seq([1, 2, 3])
    admit(bm, s1)
    for t in (4, 5, 6, 7, 8):
        s1.append_token(t)
        assert bm.allocate(s1, 1)
        s1.num_computed_tokens += 1
    bm.deallocate(s1)
    assert admit(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 2)) == 8


def test_revived_cached_blocks_count_against_free_blocks():
    """Hitting a freed cached block takes it off the free list, so it must be counted as used."""
    bm = BlockManager(3, BS)
    s1 = seq(list(range(9)))
    admit(bm, s1)
    bm.deallocate(s1)
    other = seq([100], 1)
    admit(bm, other)  # takes the block freed first (s1's last), leaving s1's two full blocks free
    s2 = seq(list(range(8)) + [7, 7, 7, 7, 7], 2)
    cached = bm.cached_prefix(s2)
    assert len(cached) == 2 and bm.num_free_blocks == 2
    assert not bm.allocate(s2, 5, cached), "2 revived + 2 new blocks do not fit in 2 free ones"
    assert not s2.block_table and bm.num_free_blocks == 2


def test_deallocate_forgets_blocks_whose_step_never_ran():
    bm = BlockManager(8, BS)
    s1 = seq(list(range(12)))
    admit(bm, s1, 4)
    assert bm.allocate(s1, 8)  # scheduled, then the step fails before computing tokens 4..11
    bm.deallocate(s1, num_valid_tokens=4)
    assert admit(bm, seq(list(range(12)), 2)) == 4


def run_in_steps(bm: BlockManager, s: Sequence, step: int, held: list[int]) -> None:
    """Compute `s` `step` tokens at a time from where it is (as chunked prefill then decode would), recording the
    blocks it holds after each step."""
    while s.num_computed_tokens < len(s):
        n = min(step, len(s) - s.num_computed_tokens)
        assert bm.allocate(s, n)
        s.num_computed_tokens += n
        held.append(sum(b != -1 for b in s.block_table))


@pytest.mark.parametrize("window, step", [(6, 1), (6, 3), (9, 4), (4, 5)])
def test_sliding_window_releases_blocks_before_the_window(window, step):
    bm = BlockManager(32, BS, sliding_window=window)
    s, held = seq(list(range(60))), []
    run_in_steps(bm, s, step, held)
    bound = -(-(window + step - 1) // BS) + 2  # the step's windows, rounded to blocks, one kept for hashing
    assert max(held) <= bound < 60 // BS, held
    first_needed = (len(s) - window) // BS  # the last query's window starts in this block
    assert all(b == -1 for b in s.block_table[:first_needed - 1])
    assert all(b != -1 for b in s.block_table[first_needed:])
    assert bm.num_released_blocks == s.block_table.count(-1) > 0
    assert bm.num_free_blocks == 32 - max(0, len(s.block_table) - s.block_table.count(-1))
    bm.deallocate(s)
    assert bm.num_free_blocks == 32 and all(block.ref_count == 0 for block in bm.blocks)


def test_sliding_window_keeps_every_block_when_off():
    bm = BlockManager(32, BS)
    s, held = seq(list(range(60))), []
    run_in_steps(bm, s, 3, held)
    assert held[-1] == 15 and -1 not in s.block_table and bm.num_released_blocks == 0


def test_a_released_block_is_hit_only_while_it_keeps_its_prefix():
    """A released block keeps its name and K/V (those of its prefix), as any freed block does: a later request with
    the same prefix hits it and releases it again; once the block is handed out anew, the prefix misses."""
    bm = BlockManager(12, BS, sliding_window=4)
    s1 = seq(list(range(30)), 1)
    run_in_steps(bm, s1, 2, [])
    released = [i for i, b in enumerate(s1.block_table) if b == -1]
    assert released[:2] == [0, 1]
    s2 = seq(list(range(12)) + [99], 2)
    cached = bm.cached_prefix(s2)
    assert len(cached) == 3 and all(bm.blocks[b].ref_count == 0 or b in s1.block_table for b in cached)
    assert bm.allocate(s2, 1, cached)
    s2.num_computed_tokens = 13
    assert s2.block_table[:2] == [-1, -1]  # released again at once: outside the window of token 12
    bm.deallocate(s1)
    bm.deallocate(s2)
    assert bm.num_free_blocks == 12 and all(block.ref_count == 0 for block in bm.blocks)
    others = [seq([7] * 40, 3 + i) for i in range(3)]
    for other in others:  # hand out every block anew
        assert bm.allocate(other, 16)
    assert bm.cached_prefix(seq(list(range(12)) + [99], 9)) == []


def test_preempting_a_sequence_with_released_blocks_frees_the_rest():
    bm = BlockManager(16, BS, sliding_window=5)
    s = seq(list(range(40)))
    run_in_steps(bm, s, 4, [])
    assert -1 in s.block_table
    bm.deallocate(s, num_valid_tokens=36)
    assert s.block_table == [] and bm.num_free_blocks == 16 and all(block.ref_count == 0 for block in bm.blocks)


def test_fork_shares_full_blocks_and_copies_a_partial_last_one():
    bm = BlockManager(8, BS)
    parent = seq(list(range(11)), 1)
    admit(bm, parent)
    child = parent.fork(2)
    assert child.token_ids == parent.token_ids and child.token_ids is not parent.token_ids
    assert bm.fork(parent, child) == [(parent.block_table[2], child.block_table[2], 3)]  # its 3 tokens' K/V
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] != parent.block_table[2]
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    assert bm.blocks[child.block_table[2]].ref_count == 1 and bm.blocks[child.block_table[2]].hash == -1
    parent.append_token(50)
    child.append_token(60)
    for s in (parent, child):  # each writes its own next token, into its own block, and names it
        assert bm.allocate(s, 1)
        s.num_computed_tokens += 1
    assert -1 != bm.blocks[parent.block_table[2]].hash != bm.blocks[child.block_table[2]].hash != -1
    bm.deallocate(parent)
    bm.deallocate(child)
    assert bm.num_free_blocks == 8 and all(block.ref_count == 0 for block in bm.blocks)


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(8, BS)
    parent = seq(list(range(8)), 1)
    admit(bm, parent)
    child = parent.fork(2)
    assert bm.fork(parent, child) == [] and child.block_table == parent.block_table
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    child.append_token(60)
    assert bm.allocate(child, 1) and child.block_table[2] not in parent.block_table
    bm.deallocate(parent)
    bm.deallocate(child)
    assert bm.num_free_blocks == 8


def test_fork_needing_a_copy_is_refused_without_a_free_block_or_copies():
    bm = BlockManager(3, BS)
    parent = seq(list(range(10)), 1)
    admit(bm, parent)
    assert bm.fork(parent, parent.fork(2)) is None
    bm2 = BlockManager(8, BS)
    admit(bm2, parent2 := seq(list(range(10)), 1))
    child = parent2.fork(2)
    assert bm2.fork(parent2, child, may_copy=False) is None and not child.block_table
    assert [bm2.blocks[b].ref_count for b in parent2.block_table] == [1, 1, 1]
