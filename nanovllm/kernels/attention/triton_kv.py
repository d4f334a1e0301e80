"""Triton kernel that writes this step's K/V rows into the paged cache (the CUDA store path).

Semantics equal `TorchBackend.store_kvcache`, its reference: row i goes to flat slot
`slot_mapping[i]`, and slot -1 (a padded row) is skipped. Unlike the boolean-mask torch
version it never syncs with the host, so CUDA graphs can capture it. The kernel only
copies (no arithmetic), so it runs unchanged under `TRITON_INTERPRET=1` on CPU for
float32, float16 and bfloat16. For an 8-bit cache the rows are converted first by torch (`to_cache_dtype`: elementwise
ops, capturable too; an int8 cache's rows with their scales): the rounding is then the CPU path's, which Triton's
interpreter does not reproduce (it rounds some values to the wrong neighbour).
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.kv_quant import to_cache_dtype


@triton.jit
def _store_kvcache_kernel(k_ptr, k_row_stride, v_ptr, v_row_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                          ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot == -1:
        return
    offsets = tl.arange(0, BLOCK)
    mask = offsets < ROW
    k = tl.load(k_ptr + token * k_row_stride + offsets, mask=mask)
    v = tl.load(v_ptr + token * v_row_stride + offsets, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offsets, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offsets, v, mask=mask)


def _check_row_layout(name: str, x: torch.Tensor) -> None:
    """Each token's `[kv_heads, head_dim]` block must be dense; the token stride may be anything."""
    if x.stride(-1) != 1 or x.stride(-2) != x.size(-1):
        raise ValueError(f"{name} must be dense within each token row, got strides {tuple(x.stride())}")


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k/v `[tokens, kv_heads, head_dim]` into caches `[num_blocks, block_size, kv_heads, head_dim]` (an int8
    cache's rows: head_dim + 4 bytes)."""
    k, v = to_cache_dtype(k, k_cache.dtype), to_cache_dtype(v, v_cache.dtype)
    num_tokens, num_kv_heads, width = k.shape
    row = num_kv_heads * width
    _check_row_layout("k", k)
    _check_row_layout("v", v)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if slot_mapping.numel() != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries for {num_tokens} tokens")
    _store_kvcache_kernel[(num_tokens,)](k, k.stride(0), v, v.stride(0), k_cache, v_cache, slot_mapping,
                                         ROW=row, BLOCK=triton.next_power_of_2(row))
