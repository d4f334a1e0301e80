from array import array

import xxhash

from nanovllm.core.sequence import Sequence


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
    a whole prefix (a first block's hash starts from its sequence's LoRA adapter, if any: `first_prefix`). A block
    is named as soon as a scheduled step fills it, so a request admitted
    later, even in the same step, can share a prefix that another request is still prefilling
    (every layer writes the step's K/V before any attention reads them). A freed block keeps its
    name and content until it is handed out again, so a later request can still hit it; free
    blocks are reused oldest-freed first.

    With `sliding_window` > 0 (every layer of the model attends only to that many last positions: vLLM's
    sliding-window manager), a sequence's blocks that lie wholly before the window of its next query are released
    as soon as it is scheduled past them: their table entries become -1 (the backends never read them) and a
    long sequence holds about `sliding_window / block_size + 2` blocks. A released block keeps its name, as
    any freed block does: its K/V are still exactly those of its prefix, so a later hit on it is correct.
    A model that mixes full-attention layers with sliding ones (Gemma 2/3) must keep every block: it passes 0.
    """

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int = 0):
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_released_blocks = 0  # released outside a sliding window, since the start
        self.peak_used_blocks = 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # ordered set, LRU first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @staticmethod
    def first_prefix(seq: Sequence) -> int:
        """What a sequence's first block hashes on: nothing (-1) for the base model; under a LoRA adapter its id, so
        that a prompt's K/V are shared only between sequences of the same adapter."""
        return BlockManager.compute_hash([-seq.lora_int_id]) if seq.lora_int_id else -1

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
        self._forget(block)
        block.reset()
        del self.free_block_ids[block_id]
        return block

    def _forget(self, block: Block) -> None:
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash = -1

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks holding the longest cached prefix of `seq`, whole blocks only.

        The block holding the last token is never a hit: the model must run that token to produce
        the next one, and so a computation never writes into a shared block.
        """
        block_ids, prefix = [], self.first_prefix(seq)
        for i in range((len(seq) - 1) // self.block_size):
            token_ids = seq.block(i)
            prefix = self.compute_hash(token_ids, prefix)
            block_id = self.hash_to_block_id.get(prefix, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            block_ids.append(block_id)
        return block_ids

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give `seq` the blocks for its next `num_new_tokens` tokens, after its `num_computed_tokens`
        (for a sequence without blocks yet: after the `cached` prefix blocks, which it then shares).
        Names every block those tokens fill. Returns False, changing nothing, if too few blocks are free."""
        assert not cached or not seq.block_table
        start = seq.num_computed_tokens + len(cached) * self.block_size
        end = start + num_new_tokens
        num_new_blocks = -(-end // self.block_size) - len(seq.block_table) - len(cached)
        revived = sum(self.blocks[block_id].ref_count == 0 for block_id in cached) if cached else 0
        if num_new_blocks + revived > self.num_free_blocks:
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count:
                block.ref_count += 1
            else:
                del self.free_block_ids[block_id]
                block.ref_count = 1
            seq.block_table.append(block_id)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._allocate_block(next(iter(self.free_block_ids))).block_id)
        self._name(seq, start, min(end, len(seq)))
        if self.sliding_window:
            self._release_outside_window(seq, start, end)
        self.peak_used_blocks = max(self.peak_used_blocks, len(self.blocks) - self.num_free_blocks)
        return True

    def _name(self, seq: Sequence, start: int, end: int) -> None:
        """Name the blocks that tokens `start..end-1` fill. Tokens past `len(seq)` (proposed drafts) are never named:
        `settle` names what was accepted of them."""
        for i in range(start // self.block_size, end // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1:
                prefix = self.blocks[seq.block_table[i - 1]].hash if i else self.first_prefix(seq)
                token_ids = seq.block(i)
                block.update(self.compute_hash(token_ids, prefix), token_ids)
                self.hash_to_block_id[block.hash] = block.block_id

    def settle(self, seq: Sequence) -> None:
        """After a verification step: name the blocks its accepted drafts filled (those before
        `num_computed_tokens`) and free the blocks past `seq.num_blocks`, which only rejected drafts used."""
        first_unnamed = len(seq.block_table)
        while first_unnamed and seq.block_table[first_unnamed - 1] != -1 and \
                self.blocks[seq.block_table[first_unnamed - 1]].hash == -1:
            first_unnamed -= 1
        self._name(seq, first_unnamed * self.block_size, seq.num_computed_tokens)
        while len(seq.block_table) > seq.num_blocks:
            self._release(seq.block_table.pop())

    def fork(self, seq: Sequence, child: Sequence, may_copy: bool = True) -> list[tuple[int, int, int]] | None:
        """Give `child`, a fork of `seq` (`Sequence.fork`: the same tokens, every one computed), `seq`'s blocks, copy
        on write: it shares every full block (ref counts), and when the last block is partial, the next token of
        each would be written into it, so `child` gets a new block instead, whose K/V must first be copied from
        `seq`'s: returned as `[(source, destination, its number of tokens)]` (empty when the last block is full)
        for the model runner's cache. None, changing nothing, when that copy is needed and `may_copy` is False or
        no block is free."""
        assert not child.block_table and seq.num_computed_tokens == len(seq) == len(child)
        partial = len(seq) % self.block_size
        if partial and (not may_copy or not self.free_block_ids):
            return None
        shared = seq.block_table[:-1] if partial else seq.block_table
        for block_id in shared:
            if block_id != -1:  # released outside the sliding window
                self.blocks[block_id].ref_count += 1
        child.block_table = list(shared)
        if not partial:
            return []
        block = self._allocate_block(next(iter(self.free_block_ids)))
        child.block_table.append(block.block_id)
        self.peak_used_blocks = max(self.peak_used_blocks, len(self.blocks) - self.num_free_blocks)
        return [(seq.block_table[-1], block.block_id, partial)]

    def _release_outside_window(self, seq: Sequence, start: int, end: int) -> None:
        """Free the blocks before the window of this step's first query (position `start`). The block before the
        one that `end` falls in stays: the next block named hashes on its name."""
        limit = min((start - self.sliding_window + 1) // self.block_size, end // self.block_size - 1)
        for i in range(limit - 1, -1, -1):
            block_id = seq.block_table[i]
            if block_id == -1:
                break
            self._release(block_id)
            seq.block_table[i] = -1
            self.num_released_blocks += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget the name of every block no sequence holds, so no later request reuses its K/V (after the model's
        weights changed, say). Blocks that sequences hold keep their names: their K/V are their sequences' own, and
        the blocks they fill next are named after them. Returns whether no name was kept (vLLM's: whether the
        cache could be reset)."""
        kept = False
        for block in self.blocks:
            if block.ref_count:
                kept |= block.hash != -1
            else:
                self._forget(block)
                block.token_ids = []
        return not kept

    def deallocate(self, seq: Sequence, num_valid_tokens: int | None = None) -> None:
        """Release `seq`'s blocks. Blocks past its first `num_valid_tokens` tokens (a step that was
        scheduled but never ran) lose their names, so nobody hits K/V that were never computed."""
        if num_valid_tokens is not None:
            for block_id in seq.block_table[num_valid_tokens // self.block_size:]:
                self._forget(self.blocks[block_id])
        for block_id in reversed(seq.block_table):
            if block_id != -1:  # released outside the sliding window
                self._release(block_id)
        seq.block_table.clear()
