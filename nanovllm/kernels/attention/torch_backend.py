"""Pure-torch attention backend: the CPU path, and the CUDA fallback of last resort."""
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanovllm.kernels.attention.context import Context
from nanovllm.kernels.attention.kv_quant import from_cache, to_cache_dtype
from nanovllm.kernels.cpu import DECODE_CHUNK, cpu_kernels, paged_decode

_CUDA_KERNELS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
DECODE_ROWS_BYTES = 64 * 2**20
"""The most partial results (float32) one call of the CPU decode kernel keeps while a step's query rows run as decodes:
a long prompt's rows go in groups under it (4,096 rows over their own prompt would keep ~80 MB at once)."""
DECODE_GATHER_BYTES = 256 * 2**20
"""The most K/V a batched decode gathers at once (CUDA): rows are taken in groups under it, so its working memory is
bounded whatever the batch and its contexts (512 rows of 40k tokens would gather tens of GB otherwise)."""


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of q `[B, H, Lq, D]` over k/v `[B, Hkv, Lk, D]` under a boolean mask, by the same kernel for every call.

    On CUDA, SDPA would otherwise pick its kernel by shape (flash for causal half-precision prefill, math for
    grouped heads under a mask), and a query row's result would change with how many rows share the call:
    a prefix-cache hit or another batch would change a request's tokens. So K/V heads are repeated (the
    memory-efficient kernel has no grouped-query support) and that kernel runs every call; its rows do not
    depend on one another. Math serves only shapes it cannot take, which depend on the model, not the batch.
    """
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    with sdpa_kernel(_CUDA_KERNELS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              softcap: float) -> torch.Tensor:
    """Attention of q `[B, H, Lq, D]` over k/v `[B, Hkv, Lk, D]` with capped scores, in transformers' eager order:
    scores scaled, capped by softcap * tanh(score / softcap), masked, softmax in float32 (SDPA cannot cap)."""
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
            softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of q `[Lq, H, D]` over k/v `[Lk, Hkv, D]`, queries aligned to the end of k; with `window`, a
    query sees only the last `window` positions up to itself.

    Always an explicit bottom-right mask, also when Lq == Lk: a prompt's rows are computed the same way
    whether its prefix came from the cache or not.
    """
    lq, lk = q.size(0), k.size(0)
    mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    if window:
        mask = mask.triu(diagonal=lk - lq - window + 1)
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # fused SDPA kernels take 4-D inputs only
    if softcap:
        return _explicit(q, k, v, mask, scale, softcap)[0].transpose(0, 1)
    return _sdpa(q, k, v, mask, scale)[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype,
            first: int = 0) -> torch.Tensor:
    """Tokens `first`..`length - 1` of one sequence, read through its block table (`first` a block boundary: the
    blocks before it may have been released), in `dtype` (an 8-bit cache's values converted back)."""
    block_size = cache.size(1)
    num_blocks = (length + block_size - 1) // block_size
    return from_cache(cache[block_table[first // block_size:num_blocks]].flatten(0, 1)[:length - first], dtype)


def _runs(block_table: list[int], length: int, block_size: int, start: int = 0) -> list[tuple[int, int]]:
    """Cached tokens `start`..`length - 1` of a sequence as (first slot, count) runs of adjacent slots."""
    runs: list[tuple[int, int]] = []
    for i in range(start // block_size, (length + block_size - 1) // block_size):
        skip = max(0, start - i * block_size)
        first, count = block_table[i] * block_size + skip, min(block_size, length - i * block_size) - skip
        if runs and sum(runs[-1]) == first:
            runs[-1] = (runs[-1][0], runs[-1][1] + count)
        else:
            runs.append((first, count))
    return runs


def _decode_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: list[int],
                     length: int, scale: float, window: int = 0) -> torch.Tensor:
    """One decode query `[H, D]` over its sequence's cached K/V, read where it lies in the cache.

    Copying K/V out of the paged cache costs more than the attention itself on CPU, so each run of
    adjacent blocks is attended as a view and the partial results are merged by their
    log-sum-exp (the flash-decoding split). A sequence whose blocks are adjacent takes one call.
    """
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    q = q[None, :, None, :]
    outs, lses = [], []
    for first, count in _runs(block_table, length, k_cache.size(1), max(0, length - window) if window else 0):
        k = from_cache(k_flat[first:first + count], q.dtype).transpose(0, 1)[None]
        v = from_cache(v_flat[first:first + count], q.dtype).transpose(0, 1)[None]
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0].view(q.size(1), q.size(3))
    total = torch.logsumexp(torch.stack(lses), dim=0)
    o = sum(o * (lse - total).exp().unsqueeze(-1) for o, lse in zip(outs, lses))
    return o.view(q.size(1), q.size(3))


class TorchBackend:
    """Per-sequence SDPA; not capturable in a CUDA graph: the store's boolean mask syncs with the host, and decode
    gathers whole block tables."""

    @staticmethod
    def prepare(device: str) -> None:
        if device == "cpu":
            cpu_kernels()

    @staticmethod
    def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        if k.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
            return kernels.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        for x, cache in ((k, k_cache), (v, v_cache)):
            x = to_cache_dtype(x[valid], cache.dtype)
            if cache.element_size() == 1:  # CUDA's index_copy_ has no float8 kernels: copy the bytes
                x, cache = x.view(torch.uint8), cache.view(torch.uint8)
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x)

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float, *,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """On CPU every query row, prompts' included, as the decode of its token: the compiled decode kernel
        (`cpu_kernels.paged_decode`) over the row's own context, whatever else shares the step, so that a row's
        result never depends on how its prompt was chunked, on prefix-cache hits or on its batch (SDPA's rows do:
        over a cached prefix a prompt's greedy tokens changed). On CUDA, or without the kernel, one sequence at a
        time through masked SDPA, except a pure CUDA decode step: one batched masked SDPA. With a sliding `window`
        only the blocks the window covers are read."""
        cpu = q.device.type == "cpu"
        if ctx.is_decode and not cpu:
            return _decode_batched(q, k_cache, v_cache, ctx, scale, window, softcap)
        if ctx.is_decode and (o := paged_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens,
                                                scale, window, softcap)) is not None:
            return o
        cu_q, lengths = ctx.cu_seqlens_q.tolist(), ctx.context_lens.tolist()
        if cpu and (o := _decode_every_row(q, k_cache, v_cache, ctx, cu_q, lengths, scale, window,
                                           softcap)) is not None:
            return o
        o = torch.zeros_like(q)
        tables = ctx.block_tables.tolist() if cpu else ctx.block_tables
        block_size = k_cache.size(1)
        for i, length in enumerate(lengths):
            rows = slice(cu_q[i], cu_q[i + 1])
            if not length:  # padding rows attend to nothing
                continue
            if cu_q[i + 1] - cu_q[i] == 1 and cpu and not softcap:
                o[rows] = _decode_in_place(q[cu_q[i]], k_cache, v_cache, tables[i], length, scale, window)
            else:
                first = max(0, length - (cu_q[i + 1] - cu_q[i]) - window + 1) // block_size * block_size \
                    if window else 0
                table = torch.as_tensor(tables[i], device=q.device)
                k, v = (_gather(cache, table, length, q.dtype, first) for cache in (k_cache, v_cache))
                o[rows] = _attend(q[rows], k, v, scale, window, softcap)
        return o


def query_rows(cu_q: list[int], lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Every query row as a decode: its sequence, its row, and the context length it attends over (row r of a
    sequence with n queries and context length L: its first L - n + 1 + r tokens)."""
    sequences, rows, context_lens = [], [], []
    for i, length in enumerate(lengths):
        n = cu_q[i + 1] - cu_q[i]
        sequences += [i] * n
        rows += range(cu_q[i], cu_q[i + 1])
        context_lens += range(length - n + 1, length + 1)
    return sequences, rows, context_lens


def _decode_every_row(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, cu_q: list[int],
                      lengths: list[int], scale: float, window: int, softcap: float) -> torch.Tensor | None:
    """Every query row of a CPU step as a single query over its context (`query_rows`), computed exactly as that
    token's decode would be, by the compiled kernel in groups of rows under `DECODE_ROWS_BYTES` of partial results;
    None (nothing done) without the kernel."""
    sequences, rows, context_lens = query_rows(cu_q, lengths)
    kv_heads, group, head_dim = k_cache.size(2), q.size(1) // k_cache.size(2), q.size(2)
    per_chunk = kv_heads * group * (head_dim + 2) * 4  # bytes of one chunk's partial results, all KV heads
    groups, start, used = [], 0, 0
    for end, context in enumerate(context_lens):
        need = -(-min(context, window or context) // DECODE_CHUNK) * per_chunk
        if used + need > DECODE_ROWS_BYTES and end > start:
            groups.append((start, end))
            start, used = end, 0
        used += need
    groups.append((start, len(rows)))
    o = torch.zeros_like(q)
    for start, end in groups:
        picked = torch.tensor(rows[start:end])
        out = paged_decode(q[picked], k_cache, v_cache, ctx.block_tables[torch.tensor(sequences[start:end])],
                           torch.tensor(context_lens[start:end], dtype=torch.int32), scale, window, softcap)
        if out is None:
            return None
        o[picked] = out
    return o


def _decode_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float,
                    window: int, softcap: float) -> torch.Tensor:
    """Every sequence's single query over its whole block table, masked to its context length (and window), in groups
    of rows whose gathered K/V stay within `DECODE_GATHER_BYTES` (each row is computed alone either way)."""
    row_bytes = 2 * ctx.block_tables.size(1) * k_cache[0].numel() * q.element_size()  # gathered, then upcast
    group = max(1, DECODE_GATHER_BYTES // row_bytes)
    if q.size(0) <= group:
        return _decode_rows(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale, window, softcap)
    return torch.cat([_decode_rows(q[i:i + group], k_cache, v_cache, ctx.block_tables[i:i + group],
                                   ctx.context_lens[i:i + group], scale, window, softcap)
                      for i in range(0, q.size(0), group)])


def _decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int, softcap: float) -> torch.Tensor:
    """The gathered blocks hold other tokens past each row's context (stale, possibly inf/NaN from a request that
    overflowed): zeroed, so a masked score or value never turns a row into NaN. A row over no keys (a padding row)
    gives zeros, as the other backends do."""
    keys = torch.arange(block_tables.size(1) * k_cache.size(1), device=q.device)
    mask = keys < context_lens[:, None]
    if window:
        mask &= keys >= context_lens[:, None] - window
    k, v = (torch.where(mask[:, None, :, None], from_cache(cache[block_tables].flatten(1, 2), q.dtype).transpose(1, 2),
                        0)
            for cache in (k_cache, v_cache))
    attend = functools.partial(_explicit, softcap=softcap) if softcap else _sdpa
    out = attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale).squeeze(2)
    return out.masked_fill(~mask.any(1)[:, None, None], 0)
