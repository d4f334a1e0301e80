"""Decode-attention micro-benchmark: one paged decode attention call per backend, timed on the same batch.

`python bench.py --attention-micro` runs it for every backend that can serve the model here (or those
named by `--attention-backend`): a decode batch (256 sequences by default) with random context lengths
up to `--micro-max-context` (2048) over a shuffled paged cache, with the model's heads and dtype. CUDA
times with CUDA events; the CPU has only the torch backend to time. Each row also reports how far the
backend's output is from the first row's, so a fast but wrong kernel shows.
"""
import random
import time
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PretrainedConfig

from benchmarks.report import markdown_table
from nanovllm.kernels.attention import Platform, load_backend
from nanovllm.kernels.attention.context import Context
from nanovllm.models.hf_config import head_dim


@dataclass
class MicroRow:
    backend: str
    batch: int
    max_context: int
    dtype: str
    us_per_call: float
    ratio: float
    max_abs_diff: float


def decode_batch(cfg: PretrainedConfig, batch: int, max_context: int, block_size: int, dtype: torch.dtype,
                 device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Context]:
    """q, the K and V caches and the context of one decode step with random lengths in 1..max_context."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, max_context) for _ in range(batch)]
    width = -(-max_context // block_size)
    blocks = list(range(batch * width))
    rng.shuffle(blocks)
    tables = [blocks[i * width:(i + 1) * width] for i in range(batch)]
    gen = torch.Generator(device).manual_seed(seed)
    kv_heads, dim = cfg.num_key_value_heads, head_dim(cfg)
    k_cache, v_cache = torch.randn(2, batch * width, block_size, kv_heads, dim, generator=gen, device=device,
                                   dtype=dtype).unbind(0)
    q = torch.randn(batch, cfg.num_attention_heads, dim, generator=gen, device=device, dtype=dtype)
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)
    ctx = Context(cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
                  cu_seqlens_k=as_int32([0] + lengths).cumsum(0, dtype=torch.int32), max_seqlen_q=1,
                  max_seqlen_k=max(lengths), context_lens=as_int32(lengths), block_tables=as_int32(tables))
    return q, k_cache, v_cache, ctx


def time_call(fn, device: str, iterations: int) -> float:
    """Mean seconds per call of `fn` after three warm-up calls (which also compile kernels)."""
    for _ in range(3):
        fn()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iterations
    start_s = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start_s) / iterations


def run_micro(cfg: PretrainedConfig, backends: list[str], batch: int, max_context: int, block_size: int,
              dtype: torch.dtype, device: str, seed: int = 0, iterations: int = 20) -> list[MicroRow]:
    q, k_cache, v_cache, ctx = decode_batch(cfg, batch, max_context, block_size, dtype, device, seed)
    scale = head_dim(cfg) ** -0.5
    platform = Platform.probe(device)
    rows, first = [], None
    for name in backends:
        backend = load_backend(name, platform)
        with torch.inference_mode():
            out = backend.attend(q, k_cache, v_cache, ctx, scale).float()
            seconds = time_call(partial(backend.attend, q, k_cache, v_cache, ctx, scale), device, iterations)
        first = (seconds, out) if first is None else first
        rows.append(MicroRow(name, batch, max_context, str(dtype).removeprefix("torch."), seconds * 1e6,
                             first[0] / seconds, float((out - first[1]).abs().max())))
    return rows


def format_micro(rows: list[MicroRow]) -> str:
    headers = ["backend", "batch", "max context", "dtype", "us per call", "speed vs first", "max |diff| vs first"]
    return markdown_table(headers, [[r.backend, str(r.batch), str(r.max_context), r.dtype, f"{r.us_per_call:.1f}",
                                     f"{r.ratio:.2f}x", f"{r.max_abs_diff:.2e}"] for r in rows])
