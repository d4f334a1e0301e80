"""Triton backend: paged attention and K/V writes in Triton, on any CUDA GPU that Triton supports."""
from nanovllm.kernels.attention.triton_attention import paged_attention
from nanovllm.kernels.attention.triton_kv import store_kvcache


class TritonBackend:
    """One Triton kernel for every step (prefill, cached-prefix chunk, decode or a mix of them), reading K/V
    through the block table, with split-KV (flash decoding) for small decode batches; see `triton_attention`.

    Works in float16, bfloat16 and float32 (true float32 dots), for any head_dim, page size and GQA
    group. A query row's output is bitwise the same whatever else is in the batch, whether its prefix
    came from the cache, and whether its step is a decode or a mixed step. Neither call syncs with the
    host and decode launches depend only on tensor shapes and Python ints, so decode steps are
    captured in CUDA graphs; the split-KV scratch is allocated per call, from the graph's pool.
    """

    store_kvcache = staticmethod(store_kvcache)
    attend = staticmethod(paged_attention)
