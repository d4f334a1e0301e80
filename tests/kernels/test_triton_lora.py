"""The Triton LoRA kernels (`nanovllm.kernels.triton_lora`) through `LoRALayer.add_to` under TRITON_INTERPRET=1 on
the CPU, against the float64 reference the CPU kernel's test uses (`lora_deltas`), and compiled for NVIDIA GPUs.

Triton reads TRITON_INTERPRET when a kernel is decorated, so the cases run in a fresh interpreter with the variable
set from the start (see test_triton_kv.py).
"""
import pytest
import torch
from interpreted import run_interpreted
from lora_deltas import IN, OUTS, adapter
from nvidia_compile import ELEMENT, compile_for_nvidia, require_nvidia_backend

pytest.importorskip("triton")

from nanovllm.layers.lora import LoRALayer, LoRAWeights  # noqa: E402

CASES = [f"{dtype}-{rows}" for dtype in ("float32", "bfloat16") for rows in (1, 2, 3, 5, 9, 17)] + \
    ["float16-4", "one-row-adapted", "large-float32", "large-bfloat16"]


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted("triton_lora_cases.py")


@pytest.mark.parametrize("case", CASES)
def test_deltas_against_a_float64_reference(results, case):
    """Slices of several ranks and scales, an adapter on one slice, one in the step that does not adapt the layer,
    base rows, rows 1 to 17, sizes over several blocks: float32 to rounding, float16/bfloat16 within their
    precision; every row no adapter of the layer reaches bit for bit as it was."""
    r = results[case]
    assert r["error"] <= (1e-6 if "float32" in case or case == "one-row-adapted" else 2e-2)
    assert r["untouched_kept"]


def test_a_graph_replays_whichever_adapters_the_slots_hold(results):
    """Steps over one row buffer (the rows past each step's padded as a graph's are), whose adapters change, go,
    and are replaced by another: each right, and every launch has the same arguments (addresses, shapes, sizes),
    so one captured graph serves them all."""
    graph = results["graph"]
    assert graph["launches"] == 5 and graph["launches_alike"]
    for step in graph["steps"]:
        assert step["error"] <= 1e-6 and step["untouched_kept"]


def test_the_engine_with_triton_deltas_equals_peft():
    """The engine adding its deltas as on CUDA (Triton, a graph's row buffer for steps of up to 8 rows), three
    adapters and the base mixed with max_loras=2: PEFT's greedy tokens, and the small steps' rows read from the
    buffer a graph reads."""
    pytest.importorskip("peft")
    r = run_interpreted("triton_lora_engine.py")
    assert r["tokens"] == r["expected"]
    assert r["buffered_steps"] >= 9  # the decode steps, at least one per output token


def bound(slices: int = 3, max_rank: int = 5) -> LoRALayer:
    layer = LoRALayer(IN, sum(OUTS), slices=slices)
    layer.bind_slots(3, max_rank, torch.float32, torch.device("cpu"))
    return layer


def test_slots_hold_the_packing_and_empty_the_rest():
    """A step's packing (the CPU kernel's) lies at the head of the slots, the slots past the step's adapters hold no
    slice, and a step without the layer's adapters leaves every slot empty."""
    layer = bound()
    weights = adapter(torch.Generator().manual_seed(0), (4, 2, 3), torch.float32)
    layer.add_adapter(7, weights)
    layer.load_slots((3, 7))
    reference = LoRALayer(IN, sum(OUTS), kernel=True)
    reference.add_adapter(7, weights)
    packed, slots = reference.packed((3, 7)), layer.slots
    a, bt, table = packed.joined()
    assert torch.equal(slots.a[:9], a) and torch.equal(a, weights.a) and torch.equal(slots.bt[:bt.numel()], bt)
    assert table[:, 0].tolist() == [1, 1, 1] and table[:, 1].tolist() == [0, 4, 6]  # slot 1's rows, from A's first
    assert torch.equal(slots.slices[:3], table) and torch.equal(slots.scales[:3], packed.scales)
    assert slots.slot_slices.tolist() == [0, 0, 3, 3]
    layer.load_slots((3,))
    assert slots.slot_slices.tolist() == [0, 0, 0, 0]


def test_an_adapter_past_a_slot_is_named():
    """Slots of rank 5 for three slices of 24, 8 and 17 columns: more slices, A rows or B values than a slot holds
    are named; an adapter of rank 5 on every slice fits."""
    weights = {ranks: adapter(torch.Generator().manual_seed(0), ranks, torch.float32)
               for ranks in ((5, 5, 5), (7, 0, 7), (5, 0, 0))}
    assert bound(slices=2).overflow(weights[5, 5, 5]) == "3 slices for one projection, more than its 2"
    assert bound().overflow(weights[7, 0, 7]) == "287 B values for one projection, more than its 245"
    doubled = LoRAWeights(weights[5, 5, 5].a.repeat(2, 1), weights[5, 0, 0].slices)
    assert bound().overflow(doubled) == "30 A rows for one projection, more than its 15"
    assert bound().overflow(weights[5, 5, 5]) is None


def compile_lora(capability: int, dtype: torch.dtype) -> None:
    """Both kernels, with the argument types `lora_add` gives them."""
    from nanovllm.kernels import triton_lora

    types = {"slices_ptr": "*i64", "slot_slices_ptr": "*i64", "row_slots_ptr": "*i64", "shrunk_ptr": "*fp32",
             "scales_ptr": "*fp32"}
    compile_for_nvidia(((triton_lora._shrink_kernel, {"BLOCK_R": triton_lora.BLOCK_R, "BLOCK_K": triton_lora.BLOCK_K}),
                        (triton_lora._expand_kernel, {"BLOCK_R": triton_lora.BLOCK_R, "BLOCK_N": triton_lora.BLOCK_N})),
                       capability, types, ELEMENT[dtype])


@pytest.mark.parametrize("capability, dtype", [(80, torch.float32), (80, torch.bfloat16), (90, torch.bfloat16),
                                               (90, torch.float16)])
def test_kernels_compile_for_nvidia_gpus(capability, dtype):
    require_nvidia_backend()
    compile_lora(capability, dtype)
