"""The `--attention-micro` mode: one paged decode attention call per backend, timed on the same batch.

`python bench.py --attention-micro` runs it for every backend that can serve the model here (or those
named by `--attention-backend`): a decode batch (256 sequences by default) with random context lengths
up to `--micro-max-context` (2048) over a shuffled paged cache, with the model's heads and dtype. CUDA
times with CUDA events; the CPU has only the torch backend to time. Each row also reports how far the
backend's output is from the first row's, so a fast but wrong kernel shows.

It measures kernels, not the engine, so no `LLM` is built: it uses the kernels room's public face,
`nanovllm.kernels.attention` (`ATTENTION_BACKENDS`, `Platform`, `unsupported`, `select_backend`, `load_backend`,
`context.Context`), the model's head size (`nanovllm.models.hf_config.head_dim`) and a GGUF file's cached config
(`benchmarks.model.config_dir`). With no engine to ask, `--dtype auto` and the block size's default are the engine's
defaults restated (`kernel_settings`): on CUDA the checkpoint's float16 or else bfloat16, on the CPU bfloat16 where
oneDNN computes it natively, else float32; blocks of 256 tokens on CUDA, 16 on the CPU.
"""
import argparse
import random
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch
from transformers import AutoConfig, PretrainedConfig

from benchmarks.machine import bench_device
from benchmarks.model import config_dir
from benchmarks.report import markdown_table
from nanovllm.kernels.attention import ATTENTION_BACKENDS, Platform, load_backend, select_backend, unsupported
from nanovllm.kernels.attention.context import Context
from nanovllm.models.hf_config import head_dim

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def run(args: argparse.Namespace) -> dict:
    """--attention-micro: decode attention us per call for each backend; prints the table, returns the rows."""
    device = bench_device(args.device)
    cfg = AutoConfig.from_pretrained(config_dir(args.model) if args.model else args.config)
    dtype, block_size = kernel_settings(args, device, cfg)
    platform = Platform.probe(device)
    runnable = [name for name in ATTENTION_BACKENDS[1:]
                if unsupported(name, platform, dtype, block_size, head_dim(cfg)) is None]
    names = list(dict.fromkeys(n for name in args.attention_backend
                               for n in (runnable if name in ("auto", "all") else [name])))
    try:
        for name in names:
            select_backend(name, platform, dtype, block_size, head_dim(cfg))
    except ValueError as e:
        sys.exit(f"bench.py: error: {e}")
    rows = run_micro(cfg, names, args.micro_batch, args.micro_max_context, block_size, dtype, device, args.seed)
    print(f"\npaged decode attention, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads of "
          f"{head_dim(cfg)}, block size {block_size}, {device}")
    print(format_micro(rows))
    return {"attention_micro": [asdict(r) for r in rows]}


def kernel_settings(args: argparse.Namespace, device: str, cfg: PretrainedConfig) -> tuple[torch.dtype, int]:
    """The dtype and KV block size to time: `--dtype` and `--kvcache-block-size`, else the engine's defaults (see the
    module's docstring)."""
    block_size = args.kvcache_block_size or (256 if device == "cuda" else 16)
    if args.dtype != "auto":
        if args.dtype not in DTYPES:
            sys.exit(f"bench.py: error: --dtype must be auto or one of {', '.join(DTYPES)}, got {args.dtype!r}")
        return DTYPES[args.dtype], block_size
    if device == "cuda":
        stored = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        stored = DTYPES.get(stored) if isinstance(stored, str) else stored
        return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16, block_size
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if native else torch.float32, block_size
