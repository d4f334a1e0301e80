"""flash-attn 4 backend (`pip install flash-attn-4`): CuTe DSL kernels for Hopper and data-center Blackwell.

Pure-Python wheels that compile their kernels at first use, so it installs on any current torch
where flash-attn 2 would have to be built from source. `flash_attn.cute` is imported on first use,
so this module imports without it.
"""
import torch

from nanovllm.kernels.attention.context import Context


class Flash4Backend:
    """One varlen call over the paged cache for every step: prefill, cached-prefix prefill and decode
    (cu_seqlens_q = 0..n) alike, which is also what a CUDA graph captures.

    With a `page_table`, flash-attn 4 takes each sequence's K length as `seqused_k` (our context
    lengths) instead of `cu_seqlens_k`; it reads only the pages those lengths cover, so the -1 padding
    of the block tables is never dereferenced. Tables and lengths are int32 with contiguous rows, as
    the runner and the graph buffers build them. `select_backend` checks the rest up front: compute
    capability 9.x-11.x, float16/bfloat16, head_dim a multiple of 8 (up to 256 on Hopper, 128 on
    Blackwell). Any block size works: pages are looked up per row.
    """


    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float, *,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """A sliding `window` is `window_size=(window - 1, 0)`; both it and `softcap` are passed only when set."""
        from flash_attn.cute import flash_attn_varlen_func

        extra = {"window_size": (window - 1, 0)} if window else {}
        if softcap:
            extra["softcap"] = softcap
        out, _ = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=ctx.cu_seqlens_q,
                                        max_seqlen_q=ctx.max_seqlen_q, seqused_k=ctx.context_lens,
                                        page_table=ctx.block_tables, softmax_scale=scale, causal=True, **extra)
        return out
