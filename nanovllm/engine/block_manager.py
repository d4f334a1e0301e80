from array import array

import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    """A fixed-size page of the KV cache. A full block also remembers its content hash and token ids."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class BlockManager:
    """Hands out KV-cache blocks and shares full blocks between sequences with the same prefix.

    A full block is identified by xxh64(previous block's hash || its token ids), so one hash names
    a whole prefix. A freed block keeps its hash and content until it is handed out again, so a
    later request can still hit it; free blocks are reused oldest-freed first.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # ordered set, LRU first
        self.used_block_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(array("q", token_ids).tobytes())
        return h.intdigest()

    def _allocate_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        del self.free_block_ids[block_id]
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids[block_id] = None

    def _remember(self, block: Block, h: int, token_ids: list[int]) -> None:
        block.update(h, token_ids)
        self.hash_to_block_id[h] = block.block_id

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` a block table, reusing cached blocks for its longest cached prefix.

        The block holding the last token is always computed, never taken from the cache: the
        model must run that token to produce the next one, and writing into a shared block is
        never allowed.
        """
        assert not seq.block_table
        prefix, cache_miss = -1, False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            full = len(token_ids) == self.block_size
            h = self.compute_hash(token_ids, prefix) if full else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids or i == seq.num_blocks - 1:
                cache_miss = True
            if cache_miss:
                block = self._allocate_block(next(iter(self.free_block_ids)))
            else:
                seq.num_cached_tokens += self.block_size
                block = self.blocks[block_id]
                if block_id in self.used_block_ids:
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if full:
                self._remember(block, h, token_ids)
            seq.block_table.append(block.block_id)
            prefix = h

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def _needs_new_block(self, seq: Sequence) -> bool:
        return len(seq) > len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        """Whether the token about to be decoded (the sequence's last) has a KV slot or can get one."""
        return self.num_free_blocks >= self._needs_new_block(seq)

    def may_append(self, seq: Sequence) -> None:
        """Make room for the last token's KV; hash the last block if that token fills it."""
        if self._needs_new_block(seq):
            seq.block_table.append(self._allocate_block(next(iter(self.free_block_ids))).block_id)
        if len(seq) % self.block_size == 0:
            prefix = self.blocks[seq.block_table[-2]].hash if len(seq.block_table) > 1 else -1
            last = self.blocks[seq.block_table[-1]]
            token_ids = seq.block(seq.num_blocks - 1)
            self._remember(last, self.compute_hash(token_ids, prefix), token_ids)
