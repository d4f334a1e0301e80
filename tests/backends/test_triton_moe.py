"""The Triton routed experts equal `grouped_experts` (their reference) under TRITON_INTERPRET=1 on CPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, so the cases run in a fresh interpreter with the variable
set from the start (see test_triton_kv.py).
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(TESTS_DIR))


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "triton_moe_cases.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case, tolerance", [("decode", 1e-5), ("prefill", 1e-5), ("one_token_many_experts", 1e-5),
                                             ("bfloat16", 2e-2)])
def test_triton_experts_equal_grouped_experts(results, case, tolerance):
    """float32 to rounding; bfloat16 within its precision (the intermediate rounds to bfloat16 on both sides, at
    different points)."""
    r = results[case]
    assert r["pairs_once"], "every (token, expert) pair appears exactly once among the aligned pairs"
    assert r["blocks_hold_their_expert"], "every pair sits in a block of its own expert"
    assert r["max_diff"] <= tolerance * r["scale"]
