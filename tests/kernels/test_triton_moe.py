"""The Triton routed experts equal `grouped_experts` (their reference) under TRITON_INTERPRET=1 on CPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, so the cases run in a fresh interpreter with the variable
set from the start (see test_triton_kv.py).
"""

import pytest
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
