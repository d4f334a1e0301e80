"""Runs the Triton LoRA kernels through `LoRALayer.add_to` on the CPU (its slots bound as on CUDA); run by
test_triton_lora.py in a fresh interpreter under TRITON_INTERPRET=1.

Prints one JSON line: per case, the largest difference from the float64 reference relative to its scale, and whether
the rows no adapter of the layer reaches stayed bit for bit; for the graph case, the same per step and whether every
step launched the kernels with the same arguments (what a captured graph replays).
"""
import json

import torch
from lora_deltas import IN, OUTS, STEP, adapter, layer_adapters, reference, row_adapters

from nanovllm.layers.lora import LoRALayer, LoRAStep, set_lora_step

SLOTS, MAX_RANK = 4, 5


def bound_layer(dtype: torch.dtype, weights: dict, in_features: int = IN, outs: tuple[int, ...] = OUTS,
                max_rank: int = MAX_RANK) -> LoRALayer:
    layer = LoRALayer(in_features, sum(outs), slices=len(outs))
    layer.bind_slots(SLOTS, max_rank, dtype, torch.device("cpu"))
    for adapter_id, w in weights.items():
        layer.add_adapter(adapter_id, w)
    return layer


def run_step(layer: LoRALayer, step: tuple[int, ...], rows_adapters: list[int], index: torch.Tensor,
             dtype: torch.dtype, seed: int) -> dict:
    """One step of `step`'s adapters over rows of `rows_adapters` (0: the base), each row's slot written into `index`
    (the rows past them padded with `SLOTS`, as `LoRAManager.start_step` does); x and y have as many rows as `index`."""
    layer.load_slots(step)
    rows = len(rows_adapters)
    index[:rows] = torch.tensor([step.index(i) if i in step else len(step) for i in rows_adapters])
    index[rows:] = SLOTS
    set_lora_step(LoRAStep(step, index))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(index.numel(), layer.in_features, generator=generator).to(dtype)
    y = torch.randn(index.numel(), layer.out_features, generator=generator).to(dtype)
    padded = rows_adapters + [0] * (index.numel() - rows)
    expected = reference(x, y, {i: w for i, w in layer.adapters.items() if i in step}, padded)
    out = layer.add_to(x, y.clone())
    untouched = [row for row, i in enumerate(padded) if i not in step or i not in layer.adapters]
    return {"error": float((out.double() - expected).abs().max() / expected.abs().max()),
            "untouched_kept": bool(torch.equal(out[untouched], y[untouched])), "checked_rows": len(untouched)}


def deltas(dtype: torch.dtype, rows_adapters: list[int], large: bool = False) -> dict:
    """`large`: sizes over several blocks of every kind (input columns, output columns with slices across their
    edges, A rows of a slot) and ranks past 16."""
    shape = dict(in_features=150, outs=(70, 33, 45)) if large else {}
    weights = layer_adapters(dtype, ((12, 12, 12), (0, 20, 0), (1, 1, 1)), **shape) if large else \
        layer_adapters(dtype)
    layer = bound_layer(dtype, weights, **shape, max_rank=20 if large else MAX_RANK)
    rows = len(rows_adapters)
    return run_step(layer, STEP, rows_adapters, torch.empty(rows, dtype=torch.int64), dtype, rows)


def graph_steps() -> dict:
    """Steps whose adapters change (and one adapter replaced by another) over one layer and one row buffer of 8 rows,
    every launch recorded: each step right, the launches all alike."""
    dtype = torch.float32
    weights = layer_adapters(dtype)
    layer = bound_layer(dtype, weights)
    launches = []
    launch = layer._triton_add
    layer._triton_add = lambda *args: (launches.append(tuple(
        (a.data_ptr(), tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in args[2:])), launch(*args))[1]
    index = torch.empty(8, dtype=torch.int64)
    steps = [((1, 2, 3, 4), [1, 2, 0, 4, 3, 1]), ((4,), [4, 0, 4]), ((), [0, 0]), ((1, 2), [2, 2, 1, 0, 1, 2, 1, 2])]
    results = [run_step(layer, step, rows, index, dtype, seed) for seed, (step, rows) in enumerate(steps)]
    layer.remove_adapter(2)
    layer.add_adapter(5, adapter(torch.Generator().manual_seed(5), (5, 5, 5), dtype))
    results.append(run_step(layer, (1, 5), [5, 1, 0, 5], index, dtype, 9))
    return {"steps": results, "launches_alike": len(set(launches)) == 1, "launches": len(launches)}


if __name__ == "__main__":
    cases = {f"{str(dtype)[6:]}-{rows}": deltas(dtype, row_adapters(rows)) for dtype in (torch.float32, torch.bfloat16)
             for rows in (1, 2, 3, 5, 9, 17)}
    cases["float16-4"] = deltas(torch.float16, row_adapters(4))
    cases["one-row-adapted"] = deltas(torch.float32, [1])
    for dtype in (torch.float32, torch.bfloat16):
        cases[f"large-{str(dtype)[6:]}"] = deltas(dtype, row_adapters(9), large=True)
    cases["graph"] = graph_steps()
    print(json.dumps(cases))
