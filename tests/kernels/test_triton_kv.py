"""The Triton KV-cache writer equals the torch writer (its reference) under TRITON_INTERPRET=1 on CPU.

Triton reads TRITON_INTERPRET when the kernel is decorated, i.e. when `nanovllm.kernels.attention.triton_kv`
is first imported, and other tests in this pytest process may import it first; so the
comparison runs in a fresh interpreter with the variable set from the start.
"""

import pytest
from interpreted import run_interpreted

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted("triton_kv_cases.py")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_triton_store_equals_torch_store(results, dtype):
    r = results[dtype]
    assert r["k_equal"] and r["v_equal"]
    assert r["rows_changed_torch"] == r["rows_changed_triton"] == r["rows_expected"]


def test_store_rejects_mismatched_slot_mapping():
    import torch

    from nanovllm.kernels.attention.triton_kv import store_kvcache

    k = torch.zeros(3, 2, 4)
    cache = torch.zeros(2, 4, 2, 4)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 3 tokens"):
        store_kvcache(k, k, cache, cache, torch.tensor([0, 1]))
