"""The Triton routed experts equal `grouped_experts` (their reference) under TRITON_INTERPRET=1 on CPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, so the cases run in a fresh interpreter with the variable
set from the start (see test_triton_kv.py).
"""

import pytest
import torch
from interpreted import run_interpreted
from nvidia_compile import ELEMENT, compile_for_nvidia, require_nvidia_backend

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted("triton_moe_cases.py")


@pytest.mark.parametrize("case, tolerance", [("decode", 1e-5), ("prefill", 1e-5), ("one_token_many_experts", 1e-5),
                                             ("bfloat16", 2e-2)])
def test_triton_experts_equal_grouped_experts(results, case, tolerance):
    """float32 to rounding; bfloat16 within its precision (the intermediate rounds to bfloat16 on both sides, at
    different points)."""
    r = results[case]
    assert r["pairs_once"], "every (token, expert) pair appears exactly once among the aligned pairs"
    assert r["blocks_hold_their_expert"], "every pair sits in a block of its own expert"
    assert r["max_diff"] <= tolerance * r["scale"]


def compile_experts(capability: int, dtype: torch.dtype) -> None:
    """Both expert kernels, with the argument types `fused_experts` gives them."""
    from nanovllm.kernels import triton_moe

    types = {"routing_ptr": "*fp32", "sorted_pairs_ptr": "*i64", "block_experts_ptr": "*i64"}
    blocks = {"BLOCK_M": triton_moe.BLOCK_M, "BLOCK_N": triton_moe.BLOCK_N, "BLOCK_K": triton_moe.BLOCK_K,
              "DOT_FP32": dtype == torch.float32}
    compile_for_nvidia(((triton_moe._gate_up_kernel, {**blocks, "TOP_K": 2}), (triton_moe._down_kernel, blocks)),
                       capability, types, ELEMENT[dtype])


@pytest.mark.parametrize("capability, dtype", [(80, torch.float32), (80, torch.bfloat16), (90, torch.bfloat16),
                                               (90, torch.float16)])
def test_kernels_compile_for_nvidia_gpus(capability, dtype):
    require_nvidia_backend()
    compile_experts(capability, dtype)
