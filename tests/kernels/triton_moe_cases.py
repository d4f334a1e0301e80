"""Compares the Triton routed experts with `grouped_experts` (their reference); run by test_triton_moe.py in a fresh
interpreter under TRITON_INTERPRET=1.

Prints one JSON line: per case, the largest absolute difference, the output's scale, and the alignment's pairs.
"""
import json

import torch

from nanovllm.kernels.triton_moe import BLOCK_M, align_pairs, fused_experts
from nanovllm.layers.moe import grouped_experts, select_experts

# (tokens, hidden, intermediate, experts, top_k, dtype): sizes off the block multiples; some leave experts unused.
CASES = {"decode": (3, 40, 24, 8, 2, torch.float32), "prefill": (37, 72, 80, 5, 3, torch.float32),
         "one_token_many_experts": (1, 32, 16, 16, 4, torch.float32), "bfloat16": (21, 72, 48, 6, 2, torch.bfloat16)}


def compare(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, renormalize=False)
    expected = grouped_experts(x, weights, ids, gate_up, down)
    got = fused_experts(x, weights, ids, gate_up, down)
    sorted_pairs, block_experts = align_pairs(ids, experts, BLOCK_M)
    real = sorted_pairs[sorted_pairs < ids.numel()]
    return {"max_diff": float((got.float() - expected.float()).abs().max()), "scale": float(expected.abs().max()),
            "pairs_once": sorted(real.tolist()) == list(range(ids.numel())),
            "blocks_hold_their_expert": all(int(ids.flatten()[p]) == int(block_experts[i // BLOCK_M])
                                            for i, p in enumerate(sorted_pairs.tolist()) if p < ids.numel())}


if __name__ == "__main__":
    print(json.dumps({name: compare(*case) for name, case in CASES.items()}))
