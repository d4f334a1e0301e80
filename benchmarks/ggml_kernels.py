"""Kernel benchmark of `ggml_linear` (compiled CPU kernels) at SmolLM2-135M's shapes, beside oneDNN's F.linear on
the same weights dequantized (bfloat16 and float32, prepacked as `layers/prepack.py` packs them). It measures kernels,
not the engine: it uses the kernels room's public face, `nanovllm.kernels.ggml`, on random weights
(`benchmarks.ggml_random`).

    python -m benchmarks.ggml_kernels [--types Q4_1,Q8_0] [--rows 1,8,32,128,512] [--threads 2]
    python -m benchmarks.ggml_kernels --step [--rows 1,8,128]   # a whole forward's linear layers

Each GGML type runs as the file has it and, where this path repacks it at load as the engine does (`as_loaded`), as
"TYPE repacked": the layout the engine's products stream; `--step` holds every weight as the engine does.

Prints, per shape (in -> out features) and activation rows, the best and the median time of the calls of a few
interleaved rounds, and the effective bandwidth at the best (the weight's bytes in its own format over the time). On a
loaded machine the best is the figure to compare: a parallel region waits for its slowest thread.
"""
import argparse
import statistics
import time
from functools import partial

import torch

from benchmarks.ggml_random import random_ggml_weight
from benchmarks.report import markdown_table
from nanovllm.kernels.ggml import BLOCK, TYPE_IDS, ggml_dequantize, ggml_linear, kernel_isa, repack, repack_lanes

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # in -> out; the last is the LM head
LAYER = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]  # q k v o gate up down
LAYERS, HEAD = 30, (576, 49152)
TYPES = dict(TYPE_IDS)  # name -> GGML type id


def time_calls(fn, budget_s: float) -> list[float]:
    """Seconds of each call, calls repeated until `budget_s` passes (at least 3)."""
    fn()
    times, end = [], time.perf_counter() + budget_s
    while len(times) < 3 or time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def as_loaded(weight: torch.Tensor, qtype: int, in_features: int) -> tuple:
    """`ggml_linear`'s weight arguments as the engine holds the weight: repacked at load into the kernels' tiles where
    this path has them (`repack_lanes`), else as the file has it."""
    lanes = repack_lanes(qtype)
    if lanes and weight.shape[0] % lanes == 0:
        return repack(weight, qtype, lanes), qtype, in_features, None, lanes
    return weight, qtype, in_features, None, 0


def bench(types: list[str], rows: list[int], rounds: int, budget_s: float) -> list[list[str]]:
    """Rows of the table; shapes whose input is not whole blocks of a type (576 values and the 256-value K-quants)
    leave that type out."""
    table = []
    for k, n in SHAPES:
        fit = [t for t in types if k % BLOCK[TYPES[t]][0] == 0]
        weights = {t: random_ggml_weight(TYPES[t], n, k) for t in fit}
        dense = ggml_dequantize(weights[fit[0]], TYPES[fit[0]], k) if fit else torch.randn(n, k) * 0.05
        packed = {dtype: torch.ops.mkldnn._reorder_linear_weight(dense.to(dtype))
                  for dtype in (torch.bfloat16, torch.float32)}
        for m in rows:
            x = torch.randn(m, k)
            calls = {}
            for t in fit:
                calls[t] = (partial(ggml_linear, x, weights[t], TYPES[t], k), weights[t].numel())
                loaded = as_loaded(weights[t], TYPES[t], k)
                if loaded[-1]:
                    calls[f"{t} repacked"] = (partial(ggml_linear, x, *loaded), weights[t].numel())
            for dtype, w in packed.items():
                name = f"oneDNN {str(dtype).removeprefix('torch.')}"
                calls[name] = (partial(torch.ops.mkldnn._linear_pointwise, x.to(dtype), w, None, "none", [], ""),
                               n * k * dtype.itemsize)
            times = {name: [] for name in calls}
            for _ in range(rounds):
                for name, (fn, _) in calls.items():
                    times[name] += time_calls(fn, budget_s)
            for name, (_, size) in calls.items():
                best, median = min(times[name]), statistics.median(times[name])
                table.append([f"{k}->{n}", str(m), name, f"{best * 1e6:.1f}", f"{median * 1e6:.1f}",
                              f"{size / best / 1e9:.1f}"])
    return table


def forward(weights: list, inputs: list[torch.Tensor], quantized: bool) -> None:
    for w, x in zip(weights, inputs):
        if quantized:
            ggml_linear(x, *w)
        else:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def bench_step(rows: list[int], rounds: int) -> list[list[str]]:
    """The linear layers of one SmolLM2-135M forward (30 layers of q, k, v, o, gate, up, down in Q4_1, the LM head in
    Q8_0, on one row: the last token's logits), each weight its own (the 98 MB stream from memory as in a model) and
    held as the engine holds it (`as_loaded`), beside the same products through oneDNN on prepacked bfloat16 and
    float32 copies."""
    quantized = [(random_ggml_weight(3, n, k, seed=i), 3, k) for i, (k, n) in enumerate(LAYER * LAYERS)]
    head = (random_ggml_weight(8, HEAD[1], HEAD[0], seed=-1 % 2**32), 8, HEAD[0])
    table = []
    steps = {"ggml Q4_1 + Q8_0 head": None, "oneDNN bfloat16": torch.bfloat16, "oneDNN float32": torch.float32}
    weights = {}
    for name, dtype in steps.items():
        if dtype is None:
            weights[name] = [as_loaded(*w) for w in [*quantized, head]]
        else:
            weights[name] = [torch.ops.mkldnn._reorder_linear_weight(ggml_dequantize(w, q, k).to(dtype))
                             for w, q, k in [*quantized, head]]
    for m in rows:
        inputs = {name: [torch.randn(m if i < len(quantized) else 1, k, dtype=dtype or torch.float32)
                         for i, (k, _) in enumerate([*LAYER * LAYERS, HEAD])] for name, dtype in steps.items()}
        times = {name: [] for name in steps}
        for _ in range(rounds):
            for name in steps:
                times[name] += time_calls(partial(forward, weights[name], inputs[name], steps[name] is None), 0.5)
        for name in steps:
            best, median = min(times[name]), statistics.median(times[name])
            table.append([str(m), name, f"{best * 1e3:.2f}", f"{median * 1e3:.2f}", f"{m / best:.0f}"])
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q4_1,Q8_0,Q4_0,Q4_K,Q6_K",
                        help=f"GGML types, comma-separated, of {', '.join(TYPES)}")
    parser.add_argument("--rows", default="1,8,32,128,512", help="activation rows per call, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.1, help="seconds per timing")
    parser.add_argument("--step", action="store_true",
                        help="time the linear layers of a whole SmolLM2-135M forward instead of single shapes")
    args = parser.parse_args(argv)
    types = [t.strip().upper() for t in args.types.split(",")]
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        parser.error(f"unknown GGML types {unknown}; choose from {', '.join(TYPES)}")
    torch.set_num_threads(args.threads)
    isa = {0: "portable", 1: "AVX2", 2: "AVX-512 VNNI"}[kernel_isa()]
    print(f"{args.threads} threads, ggml path {isa}")
    rows = [int(r) for r in args.rows.split(",")]
    with torch.no_grad():
        if args.step:
            table = bench_step(rows, args.rounds)
            print(markdown_table(["rows", "weights", "best ms/step", "median ms/step", "rows/s (best)"], table))
        else:
            table = bench(types, rows, args.rounds, args.budget)
            print(markdown_table(["shape", "rows", "kernel", "best us/call", "median us/call", "GB/s (best)"], table))


if __name__ == "__main__":
    main()
