"""The throughput mode (`python bench.py`, with `--baseline none`, `hf` or `vllm`): nanovllm on one workload, against a
baseline engine (`benchmarks.baselines`), as a report. The workload, the flags and what is measured:
`benchmarks.options`.

It drives the engine through the public API only: `LLM` (its `config`: the resolved device, dtype, attention backend,
KV block size), `SamplingParams`, `add_request`/`step`, `generate` and `stats()`. Beyond it: the KV bytes per block
(`nanovllm.execution.kv_cache.kv_block_bytes(llm.config)`, for the memory bound), the FLOP count's model shapes
(`benchmarks.flops`) and, for `--attention-backend all`, the list of backends (`nanovllm.kernels.attention`
`ATTENTION_BACKENDS`): each is tried, and one the engine refuses here (its ValueError, before any work) is left out.
"""
import argparse
import gc
import hashlib
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from itertools import product

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from benchmarks.baselines import find_vllm_python, run_baseline
from benchmarks.compete import competing_process
from benchmarks.flops import mfu, run_flops
from benchmarks.machine import PeakMemory, bench_device, matmul_peak, synchronize
from benchmarks.model import config_dir, model_under_test, weights_bytes
from benchmarks.options import SAMPLING, SCHEDULING, resolve_workload
from benchmarks.report import Measured, Row, Served, format_report, median, percentiles
from benchmarks.workload import Requests, count_parameters, make_requests
from nanovllm import LLM, SamplingParams
from nanovllm.execution.kv_cache import kv_block_bytes
from nanovllm.kernels.attention import ATTENTION_BACKENDS

BUSY = ", busy machine"  # a row measured with `competing_process` running


def run(args: argparse.Namespace) -> dict:
    """Run the workload `args` describes on every row and the baseline; print the report and return the results."""
    device = bench_device(args.device)
    try:
        resolve_workload(args, device)
    except ValueError as e:
        sys.exit(f"bench.py: error: {e}")
    with model_under_test(args) as (model_dir, baseline_dir, load_format, model_name):
        cfg = AutoConfig.from_pretrained(config_dir(model_dir))
        requests = make_requests(args, cfg.vocab_size, config_dir(model_dir))
        # before any run: its imports must not count in the first run's memory
        num_params = count_parameters(config_dir(model_dir))
        runs, baseline_runs = measure(args, device, model_dir, baseline_dir, load_format, requests)
        rows, probe_low = make_rows(args, runs, baseline_runs, cfg, requests, model_name)
    facts = next(iter(runs.values()))[0].served.facts
    probes = [m.probe for measured in [*runs.values(), *baseline_runs.values()] for m in measured]
    result = {
        "workload": {"num_seqs": args.num_seqs, "input_len": [args.min_input_len, args.max_input_len],
                     "output_len": [args.min_output_len, args.max_output_len], "prompt_tokens": requests.prompt_tokens,
                     "temperature": args.temperature, "seed": args.seed, "hf_batch_size": args.hf_batch_size,
                     "request_rate": args.request_rate, "max_concurrency": args.max_concurrency},
        "engines": {f"{measured[0].served.facts['attention']} {mode} {sampling}{BUSY * busy}"
                    + ("" if spec is None else f" {spec} speculation"):
                    measured[0].served.facts for (_, mode, sampling, busy, spec), measured in runs.items()},
        "parameters": num_params, "threads": torch.get_num_threads(),
        "matmul_probes_gflops": [p / 1e9 for p in probes], "mfu_probe_below_achieved": probe_low,
        "memory_bound_gib": facts["weights_gib"] + facts["kv_cache_gib"],
        "rows": [asdict(r) for r in rows],
    }
    print(f"\n{num_params / 1e6:.0f}M parameters, {requests.prompt_tokens} prompt tokens, {torch.get_num_threads()} "
          f"threads, matmul probes {min(probes) / 1e9:.1f}-{max(probes) / 1e9:.1f} GFLOP/s ({facts['dtype']}), "
          f"{args.repeat} run(s) per row (median shown), nanovllm memory bound {result['memory_bound_gib']:.2f} GiB "
          f"(weights {facts['weights_gib']:.2f} + KV cache {facts['kv_cache_gib']:.2f})")
    print(format_report(rows))
    for line in speculation_report(runs):
        print(line)
    if args.compete:
        quiet = {row.engine: row.tokens_per_s for row in rows if not row.engine.endswith(BUSY)}
        print("kept on a busy machine: " + ", ".join(f"{engine} {row.tokens_per_s / quiet[engine]:.0%}"
                                                     for row in rows if (engine := row.engine.removesuffix(BUSY))
                                                     in quiet and row.engine.endswith(BUSY)))
    if probe_low:
        print(f"MFU: the matmul probe read below the rate achieved by {', '.join(probe_low)}; that rate stands in "
              "for the peak there (100%)")
    return result


def attention_backends(names: list[str]) -> tuple[list[str], set[str]]:
    """The --attention-backend list with "all" expanded to every backend, in the order "auto" prefers them, repeats
    dropped ("auto" is left for the engine to resolve); and those only "all" named, which are tried and left out
    where the engine cannot run them here."""
    expanded = [n for name in names for n in (ATTENTION_BACKENDS[1:] if name == "all" else [name])]
    return list(dict.fromkeys(expanded)), set(ATTENTION_BACKENDS[1:]) - set(names) if "all" in names else set()


Key = tuple[str, str, str, bool, str | None]  # attention backend, scheduling, sampling, busy machine, speculative


def measure(args: argparse.Namespace, device: str, model_dir: str, baseline_dir: str, load_format: str,
            requests: Requests) -> tuple[dict[Key, list[Measured]], dict[bool, list[Measured]]]:
    """Every nanovllm row and the baseline, `--repeat` times, interleaved (every row, then the baseline, again), each
    condition (quiet, and busy with `--compete`) in turn. The baseline runs in the dtype the engine resolved."""
    names, optional = attention_backends(args.attention_backend)
    vllm_python = find_vllm_python(args.vllm_python, device) if args.baseline == "vllm" else None
    conditions = (False, True) if args.compete else (False,)
    specs = [None] + ([speculation_label(args)] if args.speculative else [])
    runs: dict[Key, list[Measured]] = {key: [] for key in product(names, args.scheduling, args.sampling, conditions,
                                                                  specs)}
    baseline_runs: dict[tuple[bool, str], list[Measured]] = {(busy, sampling): [] for busy in conditions
                                                               for sampling in baseline_samplings(args)}
    for _ in range(args.repeat):
        for busy in conditions:
            with competing_process() if busy else nullcontext():
                for name, mode, sampling, spec in product(names, args.scheduling, args.sampling, specs):
                    if (name, mode, sampling, busy, spec) not in runs:  # a backend left out
                        continue
                    memory = PeakMemory(device)
                    try:
                        llm = LLM(model_dir, **engine_settings(args, device, load_format, name, mode, spec))
                    except ValueError as e:  # the engine refuses before any work
                        if name not in optional:
                            sys.exit(f"bench.py: error: {e}")
                        print(f"attention backend {name} left out: {e}", file=sys.stderr)
                        runs = {key: value for key, value in runs.items() if key[0] != name}
                        if not runs:
                            sys.exit("bench.py: error: no attention backend can run here")
                        continue
                    with llm:
                        served = run_engine(llm, requests, args, memory, sampling)
                    gc.collect()
                    # the machine's matmul rate next to the run (once its engine is closed, so that the probe's
                    # buffers are not in the engine's memory), in the dtype the engine resolved
                    probe = matmul_peak(served.facts["device"], getattr(torch, served.facts["dtype"]), seconds=0.5)
                    runs[name, mode, sampling, busy, spec].append(Measured(served.seconds, served.tokens, probe,
                                                                           memory.gib, served))
                for sampling in baseline_samplings(args) if args.baseline != "none" else []:
                    facts = next(m for measured in runs.values() for m in measured).served.facts
                    baseline_runs[busy, sampling].append(run_baseline(
                        args, facts["device"], getattr(torch, facts["dtype"]), baseline_dir, load_format, requests,
                        vllm_python, sampling))
    return runs, baseline_runs


def baseline_samplings(args: argparse.Namespace) -> list[str]:
    """The `--sampling` settings the baseline runs: vLLM each (its rows compared with nanovllm's sampling alike),
    transformers the first only (at the workload's temperature)."""
    return args.sampling if args.baseline == "vllm" else args.sampling[:1]


def engine_settings(args: argparse.Namespace, device: str, load_format: str, attention_backend: str, mode: str,
                    spec: str | None) -> dict:
    """The `LLM` settings of one row."""
    settings = dict(device=device, dtype=args.dtype, enforce_eager=args.enforce_eager, load_format=load_format,
                    data_parallel_size=args.data_parallel_size, seed=args.seed,
                    max_model_len=args.max_input_len + args.max_output_len,
                    max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=attention_backend,
                    enable_chunked_prefill=SCHEDULING[mode], kv_cache_dtype=args.kv_cache_dtype,
                    speculative_config=speculative_config(args) if spec else None)
    if args.kvcache_block_size:
        settings["kvcache_block_size"] = args.kvcache_block_size
    return settings


def run_engine(llm: LLM, requests: Requests, args: argparse.Namespace, memory: PeakMemory,
               sampling: str) -> Served:
    """Time nanovllm on the requests, after a warm-up. `memory` watches the timed run, so its peak is the serving
    footprint (weights, KV cache, activations), not the transient of reading the checkpoint."""
    options = SAMPLING[sampling]
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=requests.ignore_eos,
                             **(dict(options, seed=args.seed + i) if options else {}))
              for i, n in enumerate(requests.max_tokens)]
    config = llm.config
    llm.generate([requests.prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)
    synchronize(config.device)
    with memory.watch():
        start = time.perf_counter()
        ttft, itl, tokens, outputs = serve(llm, requests, params, args.max_concurrency)
        seconds = time.perf_counter() - start
    stats = llm.stats()
    replicas = args.data_parallel_size
    facts = {"device": config.device, "dtype": str(config.torch_dtype).removeprefix("torch."),
             "attention": config.attention_backend, "data_parallel_size": replicas,
             "weights_gib": replicas * weights_bytes(config.model, config.torch_dtype) / 2**30,
             "kv_cache_gib": stats["num_blocks"] * kv_block_bytes(config) * config.tensor_parallel_size / 2**30,
             "max_num_batched_tokens": config.max_num_batched_tokens,
             "outputs_digest": hashlib.sha256(repr(outputs).encode()).hexdigest()[:16],
             "output_lens": [len(ids) for ids in outputs],
             **{key: value for key, value in stats.items() if key != "replicas"}}
    if requests.ignore_eos and tokens != sum(requests.max_tokens):
        raise RuntimeError(f"nanovllm produced {tokens} tokens, the requests asked for {sum(requests.max_tokens)}")
    return Served(seconds, tokens, ttft, itl, facts)


def serve(llm: LLM, requests: Requests, params: list[SamplingParams],
          max_concurrency: int | None = None) -> tuple[list[float], list[float], int, list[list[int]]]:
    """Feed the requests to the engine at their arrival times through `add_request`/`step`, at most
    `max_concurrency` at once (a request held back is sent, and its latency counted from, when one finishes);
    returns each request's time to first token, every inter-token latency (seconds; a step that brings a request
    several tokens, as speculative decoding does, is one), the output tokens and each request's token ids."""
    start = time.perf_counter()
    pending = list(range(len(requests.prompts)))[::-1]
    index, arrived, last, ttft, itl, tokens, finished, freed = {}, {}, {}, [], [], 0, 0, start
    token_ids: list[list[int]] = [[] for _ in requests.prompts]
    with tqdm(total=len(pending), desc="nanovllm", dynamic_ncols=True) as pbar:
        while pending or not llm.is_finished():
            now = time.perf_counter() - start
            while pending and requests.arrivals[pending[-1]] <= now and (max_concurrency is None or
                                                                         len(index) - finished < max_concurrency):
                i = pending.pop()
                index[llm.add_request(requests.prompts[i], params[i])] = i
                arrived[i] = start + requests.arrivals[i]
                if max_concurrency is not None:  # from when its slot opened, if it waited for one
                    arrived[i] = max(arrived[i], freed)
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
                tokens += len(out["token_ids"]) - len(token_ids[i])
                token_ids[i] = out["token_ids"]
                finished += out.finished
                freed = now if out.finished else freed
                pbar.update(out.finished)
    return ttft, itl, tokens, token_ids


def speculation_label(args: argparse.Namespace) -> str:
    """How rows name `--speculative`: "ngram", or "draft NAME" (with its `--draft-quantization`)."""
    if args.speculative == "ngram":
        return "ngram"
    name = os.path.basename(os.path.normpath(args.speculative))
    return f"draft {name}" + (f" {args.draft_quantization}" if args.draft_quantization else "")


def speculative_config(args: argparse.Namespace) -> dict:
    """The engine's `speculative_config` for `--speculative` ('ngram' or a draft model)."""
    if args.speculative != "ngram":
        return {"model": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
                "quantization": args.draft_quantization}
    return {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}


def speculation_report(runs: dict[Key, list[Measured]]) -> list[str]:
    """For each speculative row: its acceptance figures, and whether every output equals the row's without it."""
    lines = []
    for key, measured in runs.items():
        if key[4] is None:
            continue
        facts, plain = median(measured).served.facts, median(runs[(*key[:4], None)]).served.facts
        same = "identical to" if facts["outputs_digest"] == plain["outputs_digest"] else "DIFFERENT from"
        lines.append(f"{key[4]} speculation ({key[1]}, {key[2]}): {facts['num_accepted_tokens']} of "
                     f"{facts['num_draft_tokens']} proposed tokens accepted ({facts['spec_acceptance_rate']:.0%}), "
                     f"{facts['spec_mean_accepted_length']:.2f} tokens per verified decode; outputs {same} those "
                     "without speculation")
    return lines


def make_rows(args: argparse.Namespace, runs: dict[Key, list[Measured]],
              baseline_runs: dict[tuple[bool, str], list[Measured]], cfg, requests: Requests,
              model_name: str) -> tuple[list[Row], list[str]]:
    """One row per nanovllm configuration and condition (its median run), then the condition's baseline (vLLM's:
    one per sampling setting, after the rows that sample so); ratios within one group, against its baseline, else its
    first row. Also the rows whose matmul probe read below the rate they achieved (their MFU is capped at 100%)."""
    first = next(iter(runs.values()))[0].served.facts
    dtype_name, device_name = first["dtype"], first["device"]
    prompt_lens = [len(p) for p in requests.prompts]
    dp = f", {args.data_parallel_size} replicas" if args.data_parallel_size > 1 else ""
    rows, probe_low = [], []
    per_sampling = args.baseline == "vllm"
    for (busy, group_sampling), baseline_measured in baseline_runs.items():
        start = len(rows)
        for (_, mode, sampling, _, spec), measured in ((k, v) for k, v in runs.items() if k[3] == busy
                                                       and (not per_sampling or k[2] == group_sampling)):
            m = median(measured)
            facts = m.served.facts
            row_mfu, low = mfu(run_flops(cfg, prompt_lens, facts["output_lens"], facts["num_cached_tokens"]), m.seconds,
                               m.probe)
            label = (f"nanovllm {mode}{dp}" + ("" if sampling == "plain" else f", {sampling} sampling")
                     + ("" if spec is None else f", {spec} speculation"))
            rows.append(Row(label + BUSY * busy, facts["attention"], model_name, facts["device"], dtype_name,
                            len(requests.prompts), m.tokens, m.seconds, m.tokens / m.seconds, None, row_mfu,
                            m.peak_mem_gib, percentiles(m.served.ttft), percentiles(m.served.itl)))
            probe_low += [rows[-1].engine] if low else []
        if baseline_measured:
            m = median(baseline_measured)
            row_mfu, low = mfu(run_flops(cfg, prompt_lens, requests.max_tokens), m.seconds, m.probe)
            label = m.baseline[0] + ("" if group_sampling == "plain" else f", {group_sampling} sampling")
            rows.append(Row(label + BUSY * busy, m.baseline[1], model_name, device_name, dtype_name,
                            len(requests.prompts), m.tokens, m.seconds, m.tokens / m.seconds, None, row_mfu,
                            m.peak_mem_gib))
            probe_low += [rows[-1].engine] if low else []
        group = rows[start:]
        baseline = group[-1] if baseline_measured else group[0] if len(group) > 1 else None
        for row in group if baseline else []:
            row.ratio = row.tokens_per_s / baseline.tokens_per_s
    return rows, probe_low
