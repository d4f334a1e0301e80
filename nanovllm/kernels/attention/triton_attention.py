"""Triton paged attention for every step shape: prefills, prefill chunks over a cached prefix, decodes, and mixes.

Layout (see `nanovllm.kernels.attention.context.Context`): queries `[tokens, heads, head_dim]` packed by
`cu_seqlens_q`; K/V always read from the paged caches `[blocks, page, kv_heads, head_dim]`
through `block_tables` and `context_lens`; causal with bottom-right alignment, so the queries
of a sequence with context length c and q rows sit at absolute positions c - q .. c - 1.

Algorithm: flash attention on a fixed absolute grid.

* A program owns one Q tile: `BLOCK_Q` consecutive absolute positions x the `group` query heads
  of one KV head (`BLOCK_M = BLOCK_Q * group` rows, padded to 16 or more for `tl.dot`). Tiles are
  aligned to absolute positions (tile t holds positions [t * BLOCK_Q, (t + 1) * BLOCK_Q)), so a query
  row always sits in the same row of a same-shaped tile, whatever its sequence's q length.
* Keys are read in tiles of `BLOCK_N` absolute positions, each key's page looked up in the block
  table, and grouped into segments of `SEGMENT` keys. A segment's softmax state (running max m, sum
  l, output accumulator acc, all float32) is computed from scratch by `_segment`, then merged into
  the row's state in increasing segment order by `_merge`; `_finish` divides acc by l.
* Varlen without host syncs (vLLM's trick): the grid has `tokens // BLOCK_Q + 2 * seqs` Q-tile
  programs, an upper bound; sequence i's tiles are numbered from `cu_seqlens_q[i] // BLOCK_Q + 2 * i`,
  each program finds its sequence by binary search over `cu_seqlens_q`, and spare programs exit.
* Split-KV (flash decoding) for small decode batches: the same kernel runs up to `SPLIT_KV_PROGRAMS`
  programs per (sequence, KV head), each taking every n-th segment, writes each segment's raw
  (m, l, acc) to a float32 scratch, and `_reduce_segments_kernel` merges them with the same
  `_merge` in the same order.

Determinism: a row's output is bitwise the same whatever shares its launch, whatever its q length
and whichever path runs. The dots and row reductions (the only layout-dependent arithmetic) run
in one compiled kernel whose path is a runtime argument, on same-shaped tiles; batch-dependent
integers are not specialized on, so every step of a model runs the same binary; rows never mix;
tile and segment boundaries are absolute; a tile or segment fully masked for a row leaves its
state bitwise unchanged (`_rescale` is exactly 1 where the max does not move, exp2(-inf) is 0);
and the merges use explicit fma with fp fusion off, so the reduce kernel repeats the unified
kernel's arithmetic exactly. With a sliding window a program starts at the segment holding its tile's first
visible key: the segments it skips are fully masked for every row of the tile, so skipping them changes no bit, and
the blocks of their keys (possibly released, -1 in the table) are never read. Which path runs depends only on
shapes and Python ints (`split_segments`), and no launch reads a tensor value on the host, so a CUDA graph can capture
the decode step; its split-KV scratch (tokens x heads x segments x head_dim floats) comes from
the graph's pool.

Cost of the guarantee: every step uses the decode-sized Q tile (16 rows, as vLLM's unified Triton
kernel), so a long prefill re-reads K/V once per 16 rows from L2 rather than per 64-128 rows.

An 8-bit cache (`kv_cache_dtype="fp8"`) is read as it is stored and each tile converted to the queries' dtype
(exactly: every 8-bit float is a float16, bfloat16 and float32 value) before its dots. An int8 cache
(`kv_cache_dtype="int8"`, rows of head_dim signed magnitudes and a float32 scale, `kv_quant`) goes into the dots as its
magnitudes (exact in every dtype, as they are at most 127), each key's scale then multiplying its scores and each
value's its probabilities, as the CPU kernels apply them.

`tl.dot` takes float16/bfloat16 on tensor cores with float32 accumulation; float32 uses
`input_precision="ieee"` (true float32, not TF32). Triton's interpreter misreads bfloat16 dot
operands as integers, so under `TRITON_INTERPRET=1` bfloat16 dots run in float32 on the same
bfloat16 values (exact products, float32 sums: what the tensor cores compute).
"""
import math
import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.context import Context
from nanovllm.kernels.attention.kv_quant import INT8_CACHE, cache_row_width

SEGMENT = 256  # keys per split-KV segment: fixed, so that segment boundaries never depend on the batch
SPLIT_KV_MAX_PROGRAMS = 512  # decode batches with fewer (sequence, KV head) pairs split their keys
SPLIT_KV_PROGRAMS = 16  # programs per (sequence, KV head) that share its segments when split
MIN_BLOCK_M = 16  # tl.dot's smallest M
KV_TILE_BYTES = 16384  # one K (or V) tile per pipeline stage: 64 keys of 128 float16 dims
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_8BIT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, INT8_CACHE)  # "fp8": upcast exactly; "int8": scaled
ATTENTION_LAUNCH = dict(num_warps=4, num_stages=2, enable_fp_fusion=False)
REDUCE_LAUNCH = dict(num_warps=2, enable_fp_fusion=False)


@triton.jit
def dot(a, b, acc, DOT_FP32: tl.constexpr):
    """tl.dot, in true float32 (no TF32) when `DOT_FP32`; the MoE kernels (`nanovllm.kernels.triton_moe`) use it too."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _finite(m):
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _rescale(m_old, m_new, qk_scale):
    """exp2((m_old - m_new) * qk_scale): exactly 1 where the max did not move (even -inf to -inf), 0 from -inf."""
    return tl.where(m_old == m_new, 1.0, tl.exp2((m_old - _finite(m_new)) * qk_scale))


@triton.jit
def _empty_state(ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The softmax state (max, sum, accumulator) of no keys."""
    return (tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32),
            tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32))


@triton.jit
def _merge(m1, l1, acc1, m2, l2, acc2, qk_scale):
    """Softmax states (max, sum, accumulator) of two disjoint key sets, combined."""
    m = tl.maximum(m1, m2)
    c1 = _rescale(m1, m, qk_scale)
    c2 = _rescale(m2, m, qk_scale)
    return m, tl.fma(l1, c1, l2 * c2), tl.fma(acc1, c1[:, None], acc2 * c2[:, None])


@triton.jit
def _finish(l, acc):
    """The attention output; rows that saw no key (l = 0) come out as zeros."""
    return acc / tl.where(l == 0.0, 1.0, l)[:, None]


@triton.jit
def _capped(s, score_scale, softcap):
    """softcap * tanh(s * score_scale / softcap), tanh written with exp (saturates to +-1 without overflow)."""
    x = s * score_scale / softcap
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def _magnitudes(x, dtype):
    """An int8 cache's bytes (sign bit, 7-bit magnitude) as the signed magnitudes, in `dtype`."""
    magnitude = (x & 0x7F).to(tl.float32)
    return tl.where(x >= 0x80, -magnitude, magnitude).to(dtype)


@triton.jit
def _row_scales(cache_ptr, rows, ok, HEAD_DIM: tl.constexpr):
    """The float32 scale after each int8 cache row's head_dim bytes (0 where not `ok`), read byte by byte: a row's
    scale is 4-byte aligned only where head_dim is a multiple of 4."""
    byte = tl.arange(0, 4)
    bits = tl.load(cache_ptr + rows[:, None] + HEAD_DIM + byte[None, :], mask=ok[:, None], other=0).to(tl.uint32)
    return tl.sum(bits << (8 * byte[None, :]).to(tl.uint32), 1).to(tl.float32, bitcast=True)


@triton.jit
def _segment(q, pos, k_ptr, v_ptr, table_ptr, context_len, key_start, window, first_tile, end_tile, qk_scale,
             score_scale, softcap, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr,
             DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr, INT8: tl.constexpr):
    """Softmax state of Q-tile rows at absolute positions `pos` over key tiles first_tile..end_tile-1, from scratch.

    K/V pointers are already offset to the KV head; scores are raw dot products (scaled inside exp2), or with
    SOFTCAP the capped scaled scores. Keys below `key_start` (outside every row's window) are never read; with
    `window` > 0 a row sees keys pos - window < key <= pos. `INT8`: the caches are an int8 cache's rows.
    """
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    m, l, acc = _empty_state(BLOCK_M, HEAD_DIM_PAD)
    for tile in range(first_tile, end_tile):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = (keys < context_len) & (keys >= key_start)
        block = tl.load(table_ptr + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        k_rows = block * stride_kb + (keys % PAGE) * stride_ks
        v_rows = block * stride_vb + (keys % PAGE) * stride_vs
        k = tl.load(k_ptr + k_rows[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        if INT8:
            s = dot(q, _magnitudes(k, q.dtype), None, DOT_FP32) * _row_scales(k_ptr, k_rows, key_ok, HEAD_DIM)[None, :]
        else:
            s = dot(q, k.to(q.dtype), None, DOT_FP32)
        if SOFTCAP:
            s = _capped(s, score_scale, softcap)
        visible = (keys[None, :] <= pos[:, None]) & ((window == 0) | (keys[None, :] > pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2((s - _finite(m_new)[:, None]) * qk_scale)
        alpha = _rescale(m, m_new, qk_scale)
        l = tl.fma(l, alpha, tl.sum(p, 1))
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if INT8:
            weights = p * _row_scales(v_ptr, v_rows, key_ok, HEAD_DIM)[None, :]
            acc = dot(weights.to(q.dtype), _magnitudes(v, q.dtype), acc * alpha[:, None], DOT_FP32)
        else:
            acc = dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], DOT_FP32)
        m = m_new
    return m, l, acc


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence owning Q-tile program `tile`: sequence i's programs start at cu_seqlens_q[i] // BLOCK_Q + 2i."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], num_seqs, tl.int32)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + 2 * mid <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit(do_not_specialize=["num_seqs", "num_segments", "split", "stride_bt", "window"])
def _attention_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, cu_seqlens_q_ptr,
                      part_m_ptr, part_l_ptr, part_acc_ptr, qk_scale, score_scale, softcap, window, num_seqs,
                      num_segments, split,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                      stride_vh, stride_bt, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                      BLOCK_N: tl.constexpr, TILES_PER_SEGMENT: tl.constexpr, DOT_FP32: tl.constexpr,
                      SOFTCAP: tl.constexpr, INT8: tl.constexpr):
    """Unified (split == 0): grid (Q-tile programs, KV heads, 1), each Q tile over all its keys, into out.
    Split (split == 1, decode only): grid (sequences, KV heads, splits), every splits-th segment, into the partials."""
    kv_head = tl.program_id(1)
    if split != 0:
        seq = tl.program_id(0)
    else:
        seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, tl.program_id(0), BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    first_pos = tl.maximum(context_len - q_len, 0)  # a padding row (context 0) sits at 0 and sees no key
    local_tile = tl.where(split != 0, 0, tl.program_id(0) - (q_start // BLOCK_Q + 2 * seq))
    tile_pos = (first_pos // BLOCK_Q + local_tile) * BLOCK_Q
    if tile_pos >= first_pos + q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    pos = tile_pos + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (pos >= first_pos) & (pos < first_pos + q_len)
    token = q_start + pos - first_pos
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    kv_end = tl.minimum(tl.minimum(tile_pos + BLOCK_Q, first_pos + q_len), context_len)  # keys the tile's rows see
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    num_segs = tl.cdiv(num_tiles, TILES_PER_SEGMENT)
    key_start = tl.where(window > 0, tl.maximum(tl.maximum(tile_pos, first_pos) - window + 1, 0), 0)
    first_seg = key_start // (BLOCK_N * TILES_PER_SEGMENT)  # segments before it lie outside every row's window
    k_ptr = k_cache_ptr + kv_head * stride_kh
    v_ptr = v_cache_ptr + kv_head * stride_vh
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    part = (token * NUM_HEADS + head) * num_segments
    m, l, acc = _empty_state(BLOCK_M, HEAD_DIM_PAD)
    for seg in range(first_seg + tl.program_id(2), num_segs, tl.num_programs(2)):  # unified: all, in order
        first_tile = seg * TILES_PER_SEGMENT
        seg_m, seg_l, seg_acc = _segment(q, pos, k_ptr, v_ptr, table_ptr, context_len, key_start, window,
                                         first_tile, tl.minimum(first_tile + TILES_PER_SEGMENT, num_tiles), qk_scale,
                                         score_scale, softcap, stride_kb, stride_ks, stride_vb, stride_vs,
                                         BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE, DOT_FP32, SOFTCAP, INT8)
        if split != 0:
            tl.store(part_m_ptr + part + seg, seg_m, mask=row_ok)
            tl.store(part_l_ptr + part + seg, seg_l, mask=row_ok)
            tl.store(part_acc_ptr + (part + seg)[:, None] * HEAD_DIM_PAD + dims[None, :], seg_acc,
                     mask=row_ok[:, None])
        else:
            m, l, acc = _merge(m, l, acc, seg_m, seg_l, seg_acc, qk_scale)
    if split == 0:
        o = _finish(l, acc)
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_segments", "window"])
def _reduce_segments_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, context_lens_ptr, qk_scale, window,
                            num_segments,
                            stride_ot, stride_oh, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
                            HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                            SEGMENT_KEYS: tl.constexpr):
    """Grid (decode tokens, KV heads): merges a token's segment partials for the group's heads, in segment order, from
    the first segment its window reaches (the split kernel wrote no partials before it)."""
    token = tl.program_id(0)
    rows = tl.arange(0, BLOCK_H)
    head = tl.program_id(1) * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = (token * NUM_HEADS + head) * num_segments
    m, l, acc = _empty_state(BLOCK_H, HEAD_DIM_PAD)
    context_len = tl.load(context_lens_ptr + token)
    first_seg = tl.where(window > 0, tl.maximum(context_len - window, 0), 0) // SEGMENT_KEYS
    for seg in range(first_seg, tl.minimum(tl.cdiv(context_len, SEGMENT_KEYS), num_segments)):
        seg_m = tl.load(part_m_ptr + part + seg, mask=row_ok, other=float("-inf"))
        seg_l = tl.load(part_l_ptr + part + seg, mask=row_ok, other=0.0)
        seg_acc = tl.load(part_acc_ptr + (part + seg)[:, None] * HEAD_DIM_PAD + dims[None, :], mask=row_ok[:, None],
                          other=0.0)
        m, l, acc = _merge(m, l, acc, seg_m, seg_l, seg_acc, qk_scale)
    o = _finish(l, acc)
    tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + dims[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])


def kernel_constants(num_heads: int, num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype) -> dict:
    """`_attention_kernel`'s compile-time shape: fixed per model and dtype, never per batch (determinism needs it)."""
    group = num_heads // num_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = min(64, max(16, KV_TILE_BYTES // (head_dim_pad * dtype.itemsize)))
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return dict(NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PAGE=page,
                BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=block_n, TILES_PER_SEGMENT=SEGMENT // block_n,
                DOT_FP32=dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted))


def reduce_constants(constants: dict) -> dict:
    """`_reduce_segments_kernel`'s compile-time shape, from `kernel_constants`."""
    return dict(NUM_HEADS=constants["NUM_HEADS"], GROUP=constants["GROUP"], HEAD_DIM=constants["HEAD_DIM"],
                HEAD_DIM_PAD=constants["HEAD_DIM_PAD"], BLOCK_H=triton.next_power_of_2(constants["GROUP"]),
                SEGMENT_KEYS=SEGMENT)


def split_segments(num_tokens: int, num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int) -> int:
    """Segments per sequence when a decode step splits its keys (flash decoding), 0 when it runs unified.

    Only Python ints decide: a captured decode graph always takes the same path. Splitting pays when
    (sequence, KV head) programs alone would leave the GPU idle and contexts span several segments.
    """
    segments = triton.cdiv(max_seqlen_k, SEGMENT)
    is_decode = max_seqlen_q == 1 and num_tokens == num_seqs
    return segments if is_decode and num_seqs * num_kv_heads < SPLIT_KV_MAX_PROGRAMS and segments > 1 else 0


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype not in (q.dtype, *CACHE_8BIT_DTYPES) \
            or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"Triton attention takes float16, bfloat16 or float32 queries and caches of the same dtype "
                         f"(or 8-bit ones), got {q.dtype}, {k_cache.dtype} and {v_cache.dtype}")
    if q.size(1) % k_cache.size(2) or k_cache.shape != v_cache.shape \
            or cache_row_width(q.size(2), k_cache.dtype) != k_cache.size(3):
        raise ValueError(f"queries {tuple(q.shape)} do not fit caches {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)} [blocks, page, kv_heads, head_dim (an int8 cache's: + 4)]; heads "
                         "must be a multiple of kv_heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("queries and caches must be contiguous along head_dim")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float, *,
                    window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of packed queries `[tokens, heads, head_dim]` over the paged caches, for any step in `ctx`;
    `window` > 0: each query sees the last `window` positions up to itself; `softcap` > 0: scores (scaled) capped by
    softcap * tanh(score / softcap), after which exp2 takes them in log2(e) units."""
    _check(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.size(1), k_cache.size(2)
    num_seqs = ctx.context_lens.size(0)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    constants = kernel_constants(num_heads, num_kv_heads, head_dim, page, q.dtype)
    qk_scale = math.log2(math.e) if softcap else scale * math.log2(math.e)
    segments = split_segments(num_tokens, num_seqs, num_kv_heads, ctx.max_seqlen_q, ctx.max_seqlen_k)
    if segments:
        part_m = torch.empty(num_tokens, num_heads, segments, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, segments, constants["HEAD_DIM_PAD"], dtype=torch.float32,
                               device=q.device)
        grid = (num_seqs, num_kv_heads, min(segments, SPLIT_KV_PROGRAMS))
    else:
        part_m = part_l = part_acc = out
        grid = (num_tokens // constants["BLOCK_Q"] + 2 * num_seqs, num_kv_heads, 1)
    _attention_kernel[grid](out, q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q, part_m,
                            part_l, part_acc, qk_scale, scale, softcap or 1.0, window, num_seqs, segments,
                            1 if segments else 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                            *k_cache.stride()[:3], *v_cache.stride()[:3], ctx.block_tables.stride(0), **constants,
                            SOFTCAP=bool(softcap), INT8=k_cache.dtype == INT8_CACHE, **ATTENTION_LAUNCH)
    if segments:
        _reduce_segments_kernel[(num_tokens, num_kv_heads)](out, part_m, part_l, part_acc, ctx.context_lens, qk_scale,
                                                            window, segments, out.stride(0), out.stride(1),
                                                            **reduce_constants(constants), **REDUCE_LAUNCH)
    return out
