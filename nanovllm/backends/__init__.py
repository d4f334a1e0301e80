"""Attention backends: how K/V are written to the paged cache and how attention reads them.

Every backend has the same three operations with flash-attn semantics:

* `store_kvcache(k, v, k_cache, v_cache, slot_mapping)`: row i of k/v goes to flat slot
  `slot_mapping[i]` of the cache (`block_id * block_size + offset`); slot -1 is skipped.
* `prefill(q, k, v, k_cache, v_cache, ctx, scale)`: causal attention over sequences packed
  along dim 0 (`ctx.cu_seqlens_q`/`cu_seqlens_k`). With `ctx.block_tables` set, part of each
  sequence is a cached prefix and K/V are read from the paged cache; queries are the last
  `seqlen_q` positions of `seqlen_k` (bottom-right causal alignment).
* `decode(q, k_cache, v_cache, ctx, scale)`: one query per sequence over its first
  `ctx.context_lens[i]` cached tokens, found through `ctx.block_tables`.

Shapes: q `[tokens, heads, head_dim]`, k/v `[tokens, kv_heads, head_dim]`, caches
`[num_blocks, block_size, kv_heads, head_dim]`.
"""
from nanovllm.backends.torch_backend import TorchBackend

__all__ = ["TorchBackend"]
