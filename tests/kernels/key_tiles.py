"""An 8-bit KV cache's K as the compiled CPU kernels keep it (`KEY_TILE` in csrc/cpu_math.h): a block's tokens in tiles
of 16, a tile's keys of one KV head as [head_dim][16 tokens]. Tests build a cache in rows and tile it for the kernels,
or untile what the kernels stored."""
import torch

KEY_TILE = 16


def _values(rows: torch.Tensor) -> int:
    """Values per row: an int8 cache's (bytes) rows end in their 4-byte scale."""
    return rows.size(-1) - 4 if rows.dtype == torch.uint8 else rows.size(-1)


def tile_keys(rows: torch.Tensor) -> torch.Tensor:
    """A K cache `[blocks, block_size, kv_heads, width]` in rows, tiled (the same shape and values; an int8 cache's
    16 scales after the tile's values, in token order)."""
    return _tile(rows, transpose=True)


def untile_keys(tiled: torch.Tensor) -> torch.Tensor:
    """`tile_keys` undone."""
    return _untile(tiled, transpose=True)


def tile_values(rows: torch.Tensor) -> torch.Tensor:
    """An int8 V cache in rows, tiled as the compiled kernels keep it: a tile's values of one KV head as [16 tokens]
    [head_dim], then their 16 scales (8-bit floats' V stays in rows: returned as it is)."""
    return _tile(rows, transpose=False) if rows.dtype == torch.uint8 else rows


def untile_values(tiled: torch.Tensor) -> torch.Tensor:
    """`tile_values` undone."""
    return _untile(tiled, transpose=False) if tiled.dtype == torch.uint8 else tiled


def _tile(rows: torch.Tensor, transpose: bool) -> torch.Tensor:
    blocks, block_size, kv_heads, width = rows.shape
    tiles = rows.reshape(blocks, block_size // KEY_TILE, KEY_TILE, kv_heads, width).transpose(2, 3)
    values, scales = tiles[..., :_values(rows)], tiles[..., _values(rows):]
    values = values.transpose(-1, -2) if transpose else values
    return torch.cat([values.flatten(-2), scales.flatten(-2)], -1).reshape(rows.shape).contiguous()


def _untile(tiled: torch.Tensor, transpose: bool) -> torch.Tensor:
    blocks, block_size, kv_heads, width = tiled.shape
    head_dim = _values(tiled)
    tiles = tiled.reshape(blocks, block_size // KEY_TILE, kv_heads, KEY_TILE * width)
    values = tiles[..., :KEY_TILE * head_dim]
    values = values.unflatten(-1, (head_dim, KEY_TILE)).transpose(-1, -2) if transpose else \
        values.unflatten(-1, (KEY_TILE, head_dim))
    scales = tiles[..., KEY_TILE * head_dim:].unflatten(-1, (KEY_TILE, width - head_dim))
    return torch.cat([values, scales], -1).transpose(2, 3).reshape(tiled.shape).contiguous()


def as_torch_backend_keeps(k_cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit K cache in rows as the torch backend keeps it: tiled where the compiled CPU kernels store and read it
    (on the CPU, where they built), in rows elsewhere."""
    from nanovllm.kernels.cpu import cpu_kernels

    return tile_keys(k_cache) if k_cache.device.type == "cpu" and cpu_kernels() is not None else k_cache
