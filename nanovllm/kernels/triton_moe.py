"""Triton kernels for the routed experts on CUDA (vLLM's fused MoE, simplified): `fused_experts` computes what
`layers.moe.grouped_experts` computes, its reference.

The (token, expert) pairs are sorted by expert and each expert's run is padded to whole `BLOCK_M`-row blocks
(`align_pairs`, torch ops only: no host sync, so CUDA graphs capture it; buffers sized for the worst case). One
kernel then multiplies each block of gathered token rows by its expert's gate and up tiles and writes
silu(gate) * up; a second multiplies that by the expert's down projection and scales each row by its routing
weight. Every pair's row lands at the pair's own index, and the k rows of a token are summed at the end.

float32 multiplies in true float32 (`input_precision="ieee"`, not TF32), as transformers does; float16/bfloat16 on
tensor cores with float32 sums. The kernels run under `TRITON_INTERPRET=1` on the CPU, which is how the tests check
them; there bfloat16 operands are widened to float32 first (the interpreter misreads bfloat16 dot operands, see
`triton_attention.py`).
"""
import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.triton_attention import dot

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs `ids.flatten()` sorted by expert, each expert's run padded to a multiple of `block_m` with the
    out-of-range pair index `ids.numel()`, and the expert of every `block_m` block (-1 past the last)."""
    flat = ids.flatten()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[sorted_experts]
    capacity = pairs + num_experts * (block_m - 1)
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int64, device=ids.device)
    sorted_pairs[(padded_end - padded)[sorted_experts] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    return sorted_pairs, torch.where(block_experts < num_experts, block_experts, -1)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, hidden, inter,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_FP32: tl.constexpr):
    """out[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, inter + n]) for a block of pairs of expert e."""
    block, n_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + block)
    if expert == -1:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = pairs // TOP_K
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_expert = w_ptr + expert.to(tl.int64) * 2 * inter * hidden
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * hidden + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_expert + cols[None, :] * hidden + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_expert + (inter + cols[None, :]) * hidden + ks[:, None], mask=w_mask, other=0.0)
        gate = dot(a, w_gate, gate, DOT_FP32)
        up = dot(a, w_up, up, DOT_FP32)
    result = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + pairs[:, None] * inter + cols[None, :], result.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, routing_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, hidden, inter,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """out[pair, n] = routing[pair] * (h[pair] . w[e, n]) for a block of pairs of expert e."""
    block, n_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + block)
    if expert == -1:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_expert = w_ptr + expert.to(tl.int64) * hidden * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + pairs[:, None] * inter + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_expert + cols[None, :] * inter + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot(a, w, acc, DOT_FP32)
    routing = tl.load(routing_ptr + pairs, mask=valid, other=0.0)
    acc = acc * routing[:, None]
    tl.store(out_ptr + pairs[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """`grouped_experts` for stacked contiguous weights: x `[T, H]`, weights/ids `[T, k]`, gate_up `[E, 2I, H]`,
    down `[E, H, I]`."""
    if not (x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("fused_experts needs contiguous x, gate_up and down")
    tokens, hidden = x.shape
    num_experts, inter = down.shape[0], down.shape[2]
    top_k = ids.size(1)
    pairs = tokens * top_k
    sorted_pairs, block_experts = align_pairs(ids, num_experts, BLOCK_M)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    blocks = block_experts.numel()
    dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")
    _gate_up_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, h, sorted_pairs, block_experts, pairs, hidden, inter,
        TOP_K=top_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_FP32=dot_fp32)
    _down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        h, down, weights.flatten().contiguous(), out, sorted_pairs, block_experts, pairs, hidden, inter,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_FP32=dot_fp32)
    return out.view(tokens, top_k, hidden).sum(1)
