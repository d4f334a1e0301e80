import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 4


def seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, tokens, BS, SamplingParams())


def test_hash_chains_over_prefix():
    a = BlockManager.compute_hash([1, 2, 3, 4])
    assert a == BlockManager.compute_hash([1, 2, 3, 4])
    assert BlockManager.compute_hash([5, 6, 7, 8], a) != BlockManager.compute_hash([5, 6, 7, 8])
    assert BlockManager.compute_hash([5, 6, 7, 8], a) != BlockManager.compute_hash([5, 6, 7, 8], a + 1)


def test_allocate_shares_full_prefix_blocks_with_ref_counts():
    bm = BlockManager(8, BS)
    s1, s2 = seq(list(range(10)), 1), seq(list(range(8)) + [99, 98, 97], 2)
    bm.allocate(s1)
    assert s1.num_cached_tokens == 0 and len(s1.block_table) == 3
    bm.allocate(s2)
    assert s2.num_cached_tokens == 8
    assert s2.block_table[:2] == s1.block_table[:2] and s2.block_table[2] != s1.block_table[2]
    assert [bm.blocks[b].ref_count for b in s1.block_table] == [2, 2, 1]
    bm.deallocate(s1)
    assert [bm.blocks[b].ref_count for b in s2.block_table] == [1, 1, 1]
    bm.deallocate(s2)
    assert bm.num_free_blocks == 8 and not bm.used_block_ids


def test_different_prefix_same_block_content_misses():
    bm = BlockManager(8, BS)
    s1 = seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    s2 = seq([9, 9, 9, 9, 5, 6, 7, 8, 0])
    bm.allocate(s1)
    bm.allocate(s2)
    assert s2.num_cached_tokens == 0
    assert set(s1.block_table).isdisjoint(s2.block_table)


def test_hit_after_free_until_block_is_reused():
    bm = BlockManager(4, BS)
    s1 = seq(list(range(9)))
    bm.allocate(s1)
    cached = s1.block_table[:2]
    bm.deallocate(s1)
    s2 = seq(list(range(9)), 2)
    bm.allocate(s2)
    assert s2.num_cached_tokens == 8 and s2.block_table[:2] == cached
    bm.deallocate(s2)
    # Fill the cache with other content: the old blocks get reused and their hashes forgotten.
    filler = seq([100 + i for i in range(16)], 3)
    bm.allocate(filler)
    bm.deallocate(filler)
    s3 = seq(list(range(9)), 4)
    bm.allocate(s3)
    assert s3.num_cached_tokens == 0


def test_hash_collision_is_confirmed_against_token_ids():
    bm = BlockManager(4, BS)
    s1 = seq([1, 2, 3, 4, 5])
    bm.allocate(s1)
    h = bm.blocks[s1.block_table[0]].hash
    bm.blocks[s1.block_table[0]].token_ids = [7, 7, 7, 7]  # pretend a different block had this hash
    assert bm.hash_to_block_id[h] == s1.block_table[0]
    s2 = seq([1, 2, 3, 4, 5], 2)
    bm.allocate(s2)
    assert s2.num_cached_tokens == 0


def test_whole_prompt_hit_recomputes_last_block():
    bm = BlockManager(8, BS)
    s1 = seq(list(range(8)))
    bm.allocate(s1)
    s2 = seq(list(range(8)), 2)
    bm.allocate(s2)
    assert s2.num_cached_tokens == 4  # the block holding the last token is computed, not shared
    assert s2.block_table[0] == s1.block_table[0] and s2.block_table[1] != s1.block_table[1]


@pytest.mark.parametrize("block_size", [1, 4])
def test_can_append_and_may_append_at_block_boundary(block_size):
    bm = BlockManager(3, block_size)
    s = Sequence(0, list(range(block_size)), block_size, SamplingParams())
    bm.allocate(s)
    assert len(s.block_table) == 1
    s.append_token(42)  # its KV goes into a new block
    assert bm.can_append(s)
    bm.may_append(s)
    assert len(s.block_table) == 2
    while len(s) < 2 * block_size:
        s.append_token(43)
        bm.may_append(s)
    assert len(s.block_table) == 2
    last = bm.blocks[s.block_table[-1]]
    assert last.hash == BlockManager.compute_hash(s.block(1), bm.blocks[s.block_table[0]].hash)
    other = Sequence(1, [500], block_size, SamplingParams())
    bm.allocate(other)
    assert bm.num_free_blocks == 0
    s.append_token(44)
    assert not bm.can_append(s)


def test_decode_hashes_full_blocks_for_later_hits():
    bm = BlockManager(8, BS)
    s1 = seq([1, 2, 3])
    bm.allocate(s1)
    for t in (4, 5, 6, 7, 8):
        s1.append_token(t)
        bm.may_append(s1)
    bm.deallocate(s1)
    s2 = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 2)
    bm.allocate(s2)
    assert s2.num_cached_tokens == 8
