"""The Triton routed experts equal `grouped_experts` (their reference) under TRITON_INTERPRET=1 on CPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, so the cases run in a fresh interpreter with the variable
set from the start (see test_triton_kv.py).
"""

import pytest
import torch
from interpreted import run_interpreted

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


def compile_for_nvidia(capability: int, dtype: torch.dtype) -> None:
    """Both expert kernels compiled (not run) for an NVIDIA GPU, with the argument types `fused_experts` gives them
    and the divisibility hints the JIT would: catches what the interpreter accepts but the compiler does not."""
    import triton.compiler
    from triton.backends.compiler import GPUTarget

    from nanovllm.kernels import triton_moe

    element = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    types = {"routing_ptr": "*fp32", "sorted_pairs_ptr": "*i64", "block_experts_ptr": "*i64"}
    blocks = {"BLOCK_M": triton_moe.BLOCK_M, "BLOCK_N": triton_moe.BLOCK_N, "BLOCK_K": triton_moe.BLOCK_K,
              "DOT_FP32": dtype == torch.float32}
    for kernel, constants in ((triton_moe._gate_up_kernel, {**blocks, "TOP_K": 2}), (triton_moe._down_kernel, blocks)):
        signature = {param.name: "constexpr" if param.name in constants
                     else types.get(param.name, element if param.name.endswith("_ptr") else "i32")
                     for param in kernel.params}
        hints = {(param.num,): [["tt.divisibility", 16]] for param in kernel.params if param.name.endswith("_ptr")}
        triton.compiler.compile(triton.compiler.ASTSource(kernel, signature, constants, hints),
                                target=GPUTarget("cuda", capability, 32))


@pytest.mark.parametrize("capability, dtype", [(80, torch.float32), (80, torch.bfloat16), (90, torch.bfloat16),
                                               (90, torch.float16)])
def test_kernels_compile_for_nvidia_gpus(capability, dtype):
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    compile_for_nvidia(capability, dtype)
