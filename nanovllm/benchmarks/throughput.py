"""Throughput benchmark: nanovllm, optionally against transformers' `generate` on the same requests and weights.

The workload is nano-vLLM's: seeded random prompt token ids, random input and output lengths,
`ignore_eos`, temperature 0.6, every request submitted at once (or, with `--request-rate R`,
arriving as a Poisson process of R requests/s); throughput is output tokens per wall second after
a warm-up. Each request's time to first token (from its arrival) and inter-token latencies are
recorded, and reported as p50/p90/p99 for each scheduling mode (`--scheduling`): vLLM V1's
chunked prefill with mixed steps, and nano-vLLM's prefill-first steps, in the same run. A short
matmul probe measures the machine's dense matmul peak for the model's dtype in the same run, and
model FLOP utilization is 2 x parameters x (prompt + output tokens) / seconds / probe peak.

Without `--model` the model is built from a config (Qwen3-0.6B's by default) with random
weights. With `--baseline hf` those weights are drawn once by transformers (seeded), saved to
a temporary directory, and both engines load that same checkpoint. `--model` takes a model
directory or a .gguf file (converted once, see `nanovllm convert`).

    python bench.py                              # device defaults, random Qwen3-0.6B
    python bench.py --baseline hf --json out.json
    python bench.py --model ~/models/Qwen3-0.6B --num-seqs 64
    python bench.py --request-rate 0.5 --scheduling chunked   # latency under load
    python bench.py --scheduling chunked --sampling plain,all  # the sampler's cost with every option on
    python bench.py --attention-backend triton,flash-attn-4,torch   # one row per backend, same workload
    python bench.py --attention-micro            # decode attention us per call, every backend that runs here
    python -m nanovllm bench ...                 # the same, from an installed nanovllm
"""
import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path

import torch
from tqdm.auto import tqdm

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.attention import format_micro, run_micro
from nanovllm.backends import ATTENTION_BACKENDS, Platform, select_backend, unsupported
from nanovllm.config import Config, resolve_dtype
from nanovllm.gguf_import import resolve_model
from nanovllm.models.hf_config import head_dim
from nanovllm.benchmarks.report import markdown_table

DEFAULT_CONFIG = Path(__file__).parent.parent / "model_configs" / "qwen3-0.6b.json"

# (num_seqs, min_input, max_input, min_output, max_output, max_num_batched_tokens): nano-vLLM's published
# workload on CUDA with the engine's default budget; scaled on CPU so the whole run, baseline included, takes
# minutes on a small machine, with a budget that keeps one step under ~10 s there.
DEVICE_DEFAULTS = {"cuda": (256, 100, 1024, 100, 1024, 16384), "cpu": (32, 64, 256, 32, 128, 512)}
SCHEDULING = {"chunked": True, "prefill-first": False}
# --sampling: plain temperature sampling (the workload's), or every sampler stage on at once (a seed per request).
SAMPLING = {"plain": {}, "all": dict(top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
                                     frequency_penalty=0.5, logprobs=5)}


@dataclass
class Requests:
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclass
class Row:
    engine: str
    attention: str
    model: str
    device: str
    dtype: str
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float
    ratio: float | None
    mfu: float
    peak_mem_gib: float
    ttft_ms: dict[str, float] | None = None
    itl_ms: dict[str, float] | None = None


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p90/p99 (nearest rank) of `values` in seconds, as milliseconds; None without values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return {f"p{p}": 1000 * ordered[-(-p * len(ordered) // 100) - 1] for p in (50, 90, 99)}


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hugging Face model directory or .gguf file; default: random weights from --config")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="config.json used without --model")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="default: the model's on CUDA, float32 on CPU")
    p.add_argument("--num-seqs", type=int, help="number of requests (CUDA 256, CPU 32)")
    p.add_argument("--min-input-len", type=int, help="shortest prompt (CUDA 100, CPU 64)")
    p.add_argument("--max-input-len", type=int, help="longest prompt (CUDA 1024, CPU 256)")
    p.add_argument("--min-output-len", type=int, help="fewest output tokens (CUDA 100, CPU 32)")
    p.add_argument("--max-output-len", type=int, help="most output tokens (CUDA 1024, CPU 128)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="'hf': also run transformers' generate on the same requests and weights")
    p.add_argument("--hf-batch-size", type=int, default=32,
                   help="requests per transformers generate call (padded, each group runs to its longest request)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation")
    p.add_argument("--kvcache-block-size", type=int, help="engine KV block size (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, help="engine token budget per step (CUDA 16384, CPU 512)")
    p.add_argument("--scheduling", default="chunked,prefill-first",
                   help="comma-separated scheduling modes to run, each a row: 'chunked' (vLLM V1: chunked prefill, "
                        "mixed steps) and/or 'prefill-first' (nano-vLLM's); default both")
    p.add_argument("--sampling", default="plain",
                   help="comma-separated sampling settings to run, each a row: 'plain' (temperature only) and/or "
                        "'all' (top-p, top-k, min-p, the three penalties, a seed and 5 logprobs per request)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, arriving as a Poisson process (default: all at once)")
    p.add_argument("--attention-backend", default="auto",
                   help=f"one of {', '.join(ATTENTION_BACKENDS)}, a comma-separated list of them (the workload runs "
                        "once per backend, one row each), or 'all': every backend that can run the model here")
    p.add_argument("--attention-micro", action="store_true",
                   help="instead of the workload, time one paged decode attention call per backend (with "
                        "--attention-backend auto: every backend that can run the model here)")
    p.add_argument("--micro-batch", type=int, default=256, help="decode batch of --attention-micro (default 256)")
    p.add_argument("--micro-max-context", type=int, default=2048,
                   help="longest context of --attention-micro; lengths are uniform in 1..this (default 2048)")
    p.add_argument("--json", help="also write the results as JSON to this path")
    args = p.parse_args(argv)
    args.attention_backend = args.attention_backend.split(",")
    unknown = [name for name in args.attention_backend if name not in (*ATTENTION_BACKENDS, "all")]
    if unknown:
        p.error(f"--attention-backend: unknown {', '.join(unknown)}; choose from {', '.join(ATTENTION_BACKENDS)}, all")
    for name in ("num_seqs", "min_input_len", "max_input_len", "min_output_len", "max_output_len",
                 "hf_batch_size", "threads", "kvcache_block_size", "max_num_batched_tokens", "micro_batch",
                 "micro_max_context"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    for flag, choices in (("scheduling", SCHEDULING), ("sampling", SAMPLING)):
        setattr(args, flag, getattr(args, flag).split(","))
        unknown = [value for value in getattr(args, flag) if value not in choices]
        if unknown:
            p.error(f"--{flag} {unknown} unknown; choose from {sorted(choices)}")
    if not args.request_rate > 0:
        p.error(f"--request-rate must be positive, got {args.request_rate}")
    if args.model is not None and not (os.path.isdir(args.model) or
                                       args.model.endswith(".gguf") and os.path.isfile(args.model)):
        p.error(f"--model {args.model!r} is neither a directory nor a .gguf file")
    if args.model is None and not os.path.isfile(args.config):
        p.error(f"--config {args.config!r} not found")
    return args


def resolve_workload(args: argparse.Namespace, device: str) -> None:
    """Fill unset workload flags with the device's defaults and check the ranges."""
    names = ("num_seqs", "min_input_len", "max_input_len", "min_output_len", "max_output_len", "max_num_batched_tokens")
    for name, default in zip(names, DEVICE_DEFAULTS[device]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for kind in ("input", "output"):
        lo, hi = getattr(args, f"min_{kind}_len"), getattr(args, f"max_{kind}_len")
        if lo > hi:
            raise ValueError(f"--min-{kind}-len ({lo}) is larger than --max-{kind}-len ({hi})")


def make_requests(args: argparse.Namespace, vocab_size: int) -> Requests:
    """nano-vLLM's workload: token ids uniform in [0, 10000], lengths uniform in the given ranges."""
    rng = random.Random(args.seed)
    top = min(10000, vocab_size - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    max_tokens = [rng.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_seqs)]
    arrivals, t = [], 0.0
    for _ in range(args.num_seqs):
        arrivals.append(t)
        t += rng.expovariate(args.request_rate) if args.request_rate != float("inf") else 0.0
    return Requests(prompts, max_tokens, arrivals)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: str, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Best dense matmul rate (FLOP/s) of square products, for at least `seconds` after a warm-up."""
    n = 8192 if device == "cuda" else 2048
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    synchronize(device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - start))
    return best


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory above a baseline taken at construction, seen while `watch()` is active: allocated
    device memory on CUDA, resident host memory on CPU (sampled every 20 ms)."""

    def __init__(self, device: str):
        self.device = device
        self.base = torch.cuda.memory_allocated() if device == "cuda" else _rss_bytes()
        self.peak = self.base

    @contextmanager
    def watch(self):
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            yield
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())
            return
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                self.peak = max(self.peak, _rss_bytes())
                done.wait(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            yield
        finally:
            done.set()
            sampler.join()

    @property
    def gib(self) -> float:
        return (self.peak - self.base) / 2**30


def count_parameters(model_dir: str) -> int:
    """Parameters of the model (tied embeddings counted once), without allocating them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def write_random_checkpoint(config_path: str, out_dir: str, seed: int) -> None:
    """transformers' own random init of the config, saved as a float32 safetensors checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path), dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)


def attention_backends(names: list[str], cfg, device: str, dtype: torch.dtype, block_size: int,
                       auto_means_all: bool = False) -> list[str]:
    """The --attention-backend list with "all" (and, if asked, "auto") expanded to every backend that can serve
    this model here, in the order "auto" prefers them; "auto" is otherwise left for the engine to resolve."""
    platform = Platform.probe(device)
    runnable = [name for name in ATTENTION_BACKENDS[1:]
                if unsupported(name, platform, dtype, block_size, head_dim(cfg)) is None]
    expanded = []
    for name in names:
        expanded += runnable if name == "all" or name == "auto" and auto_means_all else [name]
    return list(dict.fromkeys(expanded))


@dataclass
class Served:
    """What one engine run measured."""

    seconds: float
    tokens: int
    ttft: list[float]
    itl: list[float]
    facts: dict


def serve(llm: LLM, requests: Requests, params: list[SamplingParams]) -> tuple[list[float], list[float], int]:
    """Feed the requests to the engine at their arrival times through `add_request`/`step`; returns each
    request's time to first token, every inter-token latency (seconds) and the output tokens."""
    start = time.perf_counter()
    pending = list(range(len(requests.prompts)))[::-1]
    index, arrived, last, ttft, itl, tokens = {}, {}, {}, [], [], 0
    with tqdm(total=len(pending), desc="nanovllm", dynamic_ncols=True) as pbar:
        while pending or not llm.is_finished():
            now = time.perf_counter() - start
            while pending and requests.arrivals[pending[-1]] <= now:
                i = pending.pop()
                index[llm.add_request(requests.prompts[i], params[i])] = i
                arrived[i] = start + requests.arrivals[i]
            if llm.is_finished():
                time.sleep(requests.arrivals[pending[-1]] - now)
                continue
            outputs = llm.step()
            synchronize(llm.config.device)
            now = time.perf_counter()
            for out in outputs:
                i = index[out.request_id]
                (itl if i in last else ttft).append(now - last.get(i, arrived[i]))
                last[i] = now
                tokens += 1
                pbar.update(out.finished)
    return ttft, itl, tokens


def run_engine(model_dir: str, load_format: str, requests: Requests, args: argparse.Namespace, memory: PeakMemory,
               sampling: str, **settings) -> Served:
    """Time nanovllm on the requests. `memory` watches the timed run, so its peak is the serving footprint
    (weights, KV cache, activations), not the transient of reading the checkpoint."""
    settings.update(device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager, load_format=load_format,
                    seed=args.seed, max_model_len=args.max_input_len + args.max_output_len,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    if args.kvcache_block_size:
        settings["kvcache_block_size"] = args.kvcache_block_size
    with LLM(model_dir, **settings) as llm:
        options = SAMPLING[sampling]
        params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True,
                                 **(dict(options, seed=args.seed + i) if options else {}))
                  for i, n in enumerate(requests.max_tokens)]
        llm.generate([requests.prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)
        synchronize(llm.config.device)
        with memory.watch():
            start = time.perf_counter()
            ttft, itl, tokens = serve(llm, requests, params)
            seconds = time.perf_counter() - start
        runner = llm.model_runner
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        facts = {"device": llm.config.device, "dtype": str(llm.config.torch_dtype).removeprefix("torch."),
                 "attention": llm.config.attention_backend,
                 "weights_gib": weights / 2**30,
                 "kv_cache_gib": runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**30,
                 "max_num_batched_tokens": llm.config.max_num_batched_tokens, **llm.stats()}
    if tokens != sum(requests.max_tokens):
        raise RuntimeError(f"nanovllm produced {tokens} tokens, the requests asked for {sum(requests.max_tokens)}")
    return Served(seconds, tokens, ttft, itl, facts)


@torch.inference_mode()
def run_hf(model_dir: str, requests: Requests, device: str, dtype: torch.dtype, args: argparse.Namespace,
           memory: PeakMemory) -> tuple[float, int, str]:
    """Time transformers' generate: groups of `--hf-batch-size` requests, left-padded, each group
    sampling up to its longest request; only the tokens each request asked for are counted. Also returns
    transformers' attention implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = 0

    def generate(prompts: list[list[int]], max_new: int) -> int:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             temperature=args.temperature, top_k=0, top_p=1.0, max_new_tokens=max_new,
                             min_new_tokens=max_new, pad_token_id=pad)
        return out.size(1) - width

    generate([requests.prompts[0][:16]], 4)
    synchronize(device)
    size = args.hf_batch_size
    groups = [range(i, min(i + size, len(requests.prompts))) for i in range(0, len(requests.prompts), size)]
    tokens = 0
    with memory.watch():
        start = time.perf_counter()
        for group in tqdm(groups, desc="transformers", dynamic_ncols=True):
            wanted = [requests.max_tokens[i] for i in group]
            generated = generate([requests.prompts[i] for i in group], max(wanted))
            tokens += sum(min(n, generated) for n in wanted)
        synchronize(device)
        return time.perf_counter() - start, tokens, model.config._attn_implementation


def save_json(result: dict, path: str | None) -> dict:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def micro(args: argparse.Namespace, device: str) -> dict:
    """--attention-micro: decode attention us per call for each backend (see `nanovllm.benchmarks.attention`)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve_model(args.model) if args.model else args.config)
    dtype = resolve_dtype(args.dtype, device, cfg)
    block_size = args.kvcache_block_size or Config.kvcache_block_size
    names = attention_backends(args.attention_backend, cfg, device, dtype, block_size, auto_means_all=True)
    try:
        for name in names:
            select_backend(name, Platform.probe(device), dtype, block_size, head_dim(cfg))
    except ValueError as e:
        sys.exit(f"bench.py: error: {e}")
    rows = run_micro(cfg, names, args.micro_batch, args.micro_max_context, block_size, dtype, device, args.seed)
    print(f"\npaged decode attention, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads of "
          f"{head_dim(cfg)}, block size {block_size}, {device}")
    print(format_micro(rows))
    return save_json({"attention_micro": [asdict(r) for r in rows]}, args.json)




def format_report(rows: list[Row]) -> str:
    throughput = markdown_table(
        ["engine", "attention", "model", "device", "dtype", "requests", "tokens", "seconds", "tokens/s",
         "vs baseline", "MFU", "peak mem GiB"],
        [[r.engine, r.attention, r.model, r.device, r.dtype, str(r.requests), str(r.tokens), f"{r.seconds:.1f}",
          f"{r.tokens_per_s:.1f}", "-" if r.ratio is None else f"{r.ratio:.2f}x", f"{100 * r.mfu:.1f}%",
          f"{r.peak_mem_gib:.2f}"] for r in rows])
    timed = [r for r in rows if r.ttft_ms]
    ms = lambda p: ["-"] * 3 if p is None else [f"{v:.0f}" for v in p.values()]
    latency = markdown_table(
        ["engine", "attention", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms"],
        [[r.engine, r.attention, *ms(r.ttft_ms), *ms(r.itl_ms)] for r in timed])
    return throughput + "\n\n" + latency if timed else throughput


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    args = parse_args(argv, prog)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    if args.attention_micro:
        return micro(args, device)
    try:
        resolve_workload(args, device)
    except ValueError as e:
        sys.exit(f"bench.py: error: {e}")
    tmp = None if args.model else tempfile.mkdtemp(prefix="nanovllm-bench-")
    try:
        if args.model:
            model_dir, load_format = resolve_model(args.model), "auto"
            model_name = Path(os.path.normpath(args.model)).name.removesuffix(".gguf")
        else:
            model_dir, model_name = tmp, Path(args.config).stem + " (random)"
            shutil.copy(args.config, os.path.join(tmp, "config.json"))
            load_format = "dummy"
            if args.baseline == "hf":
                print("writing a random checkpoint for both engines ...", file=sys.stderr)
                write_random_checkpoint(args.config, tmp, args.seed)
                load_format = "auto"
        num_params = count_parameters(model_dir)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_dir)
        requests = make_requests(args, cfg.vocab_size)
        names = attention_backends(args.attention_backend, cfg, device, resolve_dtype(args.dtype, device, cfg),
                                   args.kvcache_block_size or Config.kvcache_block_size)
        runs = {}
        for name, mode, sampling in product(names, args.scheduling, args.sampling):
            mem = PeakMemory(device)
            runs[name, mode, sampling] = mem, run_engine(model_dir, load_format, requests, args, mem, sampling,
                                                         attention_backend=name, enable_chunked_prefill=SCHEDULING[mode])
            gc.collect()
        facts = next(iter(runs.values()))[1].facts
        dtype = getattr(torch, facts["dtype"])
        peak = matmul_peak(facts["device"], dtype)
        model_flops = lambda out_tokens: 2 * num_params * (requests.prompt_tokens + out_tokens)
        rows = [Row(f"nanovllm {mode}" + ("" if sampling == "plain" else f", {sampling} sampling"),
                    run.facts["attention"], model_name, run.facts["device"], run.facts["dtype"],
                    len(requests.prompts), run.tokens, run.seconds, run.tokens / run.seconds, None,
                    model_flops(run.tokens) / run.seconds / peak, mem.gib, percentiles(run.ttft), percentiles(run.itl))
                for (_, mode, sampling), (mem, run) in runs.items()]
        if args.baseline == "hf":
            mem = PeakMemory(device)
            hf_seconds, hf_tokens, hf_attention = run_hf(model_dir, requests, facts["device"], dtype, args, mem)
            rows.append(Row("transformers", hf_attention, model_name, facts["device"], facts["dtype"],
                            len(requests.prompts), hf_tokens, hf_seconds, hf_tokens / hf_seconds, None,
                            model_flops(hf_tokens) / hf_seconds / peak, mem.gib))
        baseline = rows[-1] if args.baseline == "hf" else rows[0] if len(rows) > 1 else None
        for row in rows if baseline else []:
            row.ratio = row.tokens_per_s / baseline.tokens_per_s
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "workload": {"num_seqs": args.num_seqs, "input_len": [args.min_input_len, args.max_input_len],
                     "output_len": [args.min_output_len, args.max_output_len], "prompt_tokens": requests.prompt_tokens,
                     "temperature": args.temperature, "seed": args.seed, "hf_batch_size": args.hf_batch_size,
                     "request_rate": args.request_rate},
        "engines": {f"{run.facts['attention']} {mode} {sampling}": run.facts
                    for (_, mode, sampling), (_, run) in runs.items()},
        "parameters": num_params, "threads": torch.get_num_threads(), "matmul_peak_gflops": peak / 1e9,
        "memory_bound_gib": facts["weights_gib"] + facts["kv_cache_gib"],
        "rows": [asdict(r) for r in rows],
    }
    print(f"\n{num_params / 1e6:.0f}M parameters, {requests.prompt_tokens} prompt tokens, {torch.get_num_threads()} "
          f"threads, matmul probe {peak / 1e9:.1f} GFLOP/s ({facts['dtype']}), nanovllm memory bound "
          f"{result['memory_bound_gib']:.2f} GiB (weights {facts['weights_gib']:.2f} + KV cache {facts['kv_cache_gib']:.2f})")
    print(format_report(rows))
    return save_json(result, args.json)


if __name__ == "__main__":
    main()
