"""Which data-parallel replica serves a request: the one whose prefix cache likely holds its prompt's start."""
from nanovllm.core.block_manager import BlockManager


class PrefixRouter:
    """Prompts whose first KV block is the same (the block's xxh64 hash, as the block manager names it) go to the
    replica that got the first of them, as long as it lives; other prompts go to the live replica with the least
    outstanding work."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.owners: dict[int, int] = {}

    def choose(self, token_ids: list[int], loads: dict[int, int]) -> int:
        """The replica for a prompt of `token_ids`, among the live ones in `loads` (index -> outstanding work)."""
        key = None
        if len(token_ids) >= self.block_size:
            key = BlockManager.compute_hash(token_ids[:self.block_size])
        replica = self.owners.get(key)
        if replica not in loads:
            replica = min(loads, key=lambda index: (loads[index], index))
        if key is not None:
            self.owners[key] = replica
        return replica
