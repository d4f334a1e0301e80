"""flash-attn 2 backend (`pip install flash-attn`), imported on first use, so this module imports without it."""
import torch

from nanovllm.kernels.attention.context import Context


class FlashBackend:
    """Varlen prefill (reading a cached prefix through the block table) and paged decode.

    flash-attn's paged KV path needs a cache block size that is a multiple of 256 and a
    float16/bfloat16 cache, on compute capability 8.0 or newer; `select_backend` checks these before
    choosing this backend. Decode runs unsplit (`num_splits=1`): flash-attn would otherwise split long
    contexts by a heuristic of the batch size, and a request's tokens would depend on its batch.
    A prefill step in which every sequence has one new token (a prompt one token past a cached block
    edge) takes the decode kernel, which rounds differently from the varlen one: the one place where
    a prefix-cache hit changes how this backend computes a row. flash-attn 4 has a single kernel.
    """


    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float, *,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """A sliding `window` is flash-attn's `window_size=(window - 1, 0)` (the query and the window - 1 keys
        before it): it skips the blocks before the window, which may have been released."""
        window_size = (window - 1, 0) if window else (-1, -1)
        if ctx.is_decode:
            from flash_attn import flash_attn_with_kvcache

            o = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens,
                                        block_table=ctx.block_tables, softmax_scale=scale, causal=True,
                                        window_size=window_size, softcap=softcap, num_splits=1)
            return o.squeeze(1)
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=ctx.cu_seqlens_k,
                                      max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                                      softmax_scale=scale, causal=True, window_size=window_size, softcap=softcap,
                                      block_table=ctx.block_tables)
