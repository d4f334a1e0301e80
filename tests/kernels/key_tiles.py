"""An 8-bit KV cache's K as the compiled CPU kernels keep it (`KEY_TILE` in csrc/cpu_math.h): a block's tokens in tiles
of 16, a tile's keys of one KV head as [head_dim][16 tokens]. Tests build a cache in rows and tile it for the kernels,
or untile what the kernels stored."""
import torch

KEY_TILE = 16


def tile_keys(rows: torch.Tensor) -> torch.Tensor:
    """A K cache `[blocks, block_size, kv_heads, head_dim]` in rows, tiled (the same shape and values)."""
    blocks, block_size, kv_heads, head_dim = rows.shape
    tiles = rows.reshape(blocks, block_size // KEY_TILE, KEY_TILE, kv_heads, head_dim)
    return tiles.permute(0, 1, 3, 4, 2).reshape(rows.shape).contiguous()


def untile_keys(tiled: torch.Tensor) -> torch.Tensor:
    """`tile_keys` undone."""
    blocks, block_size, kv_heads, head_dim = tiled.shape
    tiles = tiled.reshape(blocks, block_size // KEY_TILE, kv_heads, head_dim, KEY_TILE)
    return tiles.permute(0, 1, 4, 2, 3).reshape(tiled.shape).contiguous()


def as_torch_backend_keeps(k_cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit K cache in rows as the torch backend keeps it: tiled where the compiled CPU kernels store and read it
    (on the CPU, where they built), in rows elsewhere."""
    from nanovllm.kernels.cpu import cpu_kernels

    return tile_keys(k_cache) if k_cache.device.type == "cpu" and cpu_kernels() is not None else k_cache
