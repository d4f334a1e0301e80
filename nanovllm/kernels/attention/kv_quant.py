"""K/V as an 8-bit KV cache stores them. `kv_cache_dtype="fp8"`: each value saturated at the format's largest finite
value, then rounded to nearest as torch converts (a value beyond it would become NaN in e4m3 and infinity in e5m2).
`kv_cache_dtype="int8"`: a cache of bytes (`INT8_CACHE`) whose rows, one per token and KV head, hold head_dim values
and then their float32 scale (the row's largest magnitude / 127): each value its magnitude / scale rounded to nearest
even in the low 7 bits, its sign in the top bit (sign and magnitude, not two's complement: the compiled kernels widen
such bytes by the same tables as 8-bit floats). The compiled CPU store (`store_row`, `store_int8`, `store_key` in
`csrc/cpu_math.h`) rounds the same way, and keeps K (an int8 cache's V too) in tiles of 16 tokens for the decode
kernel (its blocks a multiple of 16 tokens); the torch fallback keeps rows. Every reader converts the stored values
back and computes in the model's dtype."""
import torch

INT8_CACHE = torch.uint8
INT8_SCALE_BYTES = 4


def cache_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in a cache of `dtype`: head_dim values, and an int8 cache's scale."""
    return head_dim + INT8_SCALE_BYTES if dtype == INT8_CACHE else head_dim


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` `[..., head_dim]` as a cache of `dtype` stores it (itself when `dtype` is its own; an int8 cache's rows
    are 4 bytes wider)."""
    if x.dtype == dtype:
        return x
    if dtype == INT8_CACHE:
        return _to_int8(x)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows `[..., width]` back as values of `dtype` (`[..., head_dim]`)."""
    if rows.dtype != INT8_CACHE:
        return rows.to(dtype)
    values = rows[..., :-INT8_SCALE_BYTES]
    scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    magnitude = (values & 0x7F).float()
    return torch.where(values >= 0x80, -magnitude, magnitude).mul_(scale).to(dtype)


def _to_int8(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    ratio = torch.where(scale > 0, x.abs() / scale, 0.0)
    magnitude = torch.where(ratio < 127, ratio, 127.0).round().to(torch.uint8)
    return torch.cat([magnitude | (x < 0).to(torch.uint8) << 7, scale.view(torch.uint8)], -1)
