"""K/V as an 8-bit KV cache stores them (`kv_cache_dtype="fp8"`): each value saturated at the format's largest finite
value, then rounded to nearest as torch converts (a value beyond it would become NaN in e4m3 and infinity in e5m2).
The compiled CPU store (`store_row`, `store_key` in `csrc/cpu_math.h`) rounds the same way, and keeps K in tiles of
16 tokens for the decode kernel (its blocks a multiple of 16 tokens); every reader converts the stored values back
exactly and computes in the model's dtype."""
import torch


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype` stores it (itself when `dtype` is its own)."""
    if x.dtype == dtype:
        return x
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)
