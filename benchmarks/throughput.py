"""The throughput benchmark: nanovllm on one workload, against a baseline engine (`baselines`), as a report.

The workload, the flags and what is measured: `benchmarks.options`.
"""
import argparse
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from itertools import product
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks.attention import format_micro, run_micro
from benchmarks.baselines import find_vllm_python, run_baseline
from benchmarks.compete import competing_process
from benchmarks.flops import mfu, run_flops
from benchmarks.llamacpp import compare as compare_with_llamacpp
from benchmarks.machine import PeakMemory, matmul_peak, synchronize
from benchmarks.options import SAMPLING, SCHEDULING, parse_args, resolve_workload
from benchmarks.report import Measured, Row, Served, format_report, markdown_table, median, percentiles
from benchmarks.workload import Requests, count_parameters, make_requests, write_random_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.config import default_block_size
from nanovllm.engine.setup import resolve_device, resolve_dtype
from nanovllm.execution.kv_cache import kv_block_bytes
from nanovllm.kernels.attention import ATTENTION_BACKENDS, Platform, select_backend, unsupported
from nanovllm.models.gguf.convert import convert_gguf
from nanovllm.models.gguf.metadata import cached_metadata, find_gguf
from nanovllm.models.hf_config import head_dim

BUSY = ", busy machine"  # a row measured with `competing_process` running


def config_dir(model: str) -> str:
    """The directory holding the model's config.json: the model directory, or a GGUF file's metadata."""
    gguf = find_gguf(model)
    return str(cached_metadata(gguf)) if gguf else model


def weights_bytes(model: str, dtype: torch.dtype) -> int:
    """What the weights take in memory: a GGUF file's size (its weights stay as stored), else parameters x dtype."""
    gguf = find_gguf(model)
    return os.path.getsize(gguf) if gguf else count_parameters(model) * dtype.itemsize


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


def serve(llm: LLM, requests: Requests,
          params: list[SamplingParams]) -> tuple[list[float], list[float], int, list[list[int]]]:
    """Feed the requests to the engine at their arrival times through `add_request`/`step`; returns each
    request's time to first token, every inter-token latency (seconds; a step that brings a request several tokens,
    as speculative decoding does, is one), the output tokens and each request's token ids."""
    start = time.perf_counter()
    pending = list(range(len(requests.prompts)))[::-1]
    index, arrived, last, ttft, itl, tokens = {}, {}, {}, [], [], 0
    token_ids: list[list[int]] = [[] for _ in requests.prompts]
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
                tokens += len(out["token_ids"]) - len(token_ids[i])
                token_ids[i] = out["token_ids"]
                pbar.update(out.finished)
    return ttft, itl, tokens, token_ids


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
        params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=requests.ignore_eos,
                                 **(dict(options, seed=args.seed + i) if options else {}))
                  for i, n in enumerate(requests.max_tokens)]
        llm.generate([requests.prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)
        synchronize(llm.config.device)
        with memory.watch():
            start = time.perf_counter()
            ttft, itl, tokens, outputs = serve(llm, requests, params)
            seconds = time.perf_counter() - start
        stats = llm.stats()
        replicas = args.data_parallel_size
        facts = {"device": llm.config.device, "dtype": str(llm.config.torch_dtype).removeprefix("torch."),
                 "attention": llm.config.attention_backend, "data_parallel_size": replicas,
                 "weights_gib": replicas * weights_bytes(model_dir, llm.config.torch_dtype) / 2**30,
                 "kv_cache_gib": stats["num_blocks"] * kv_block_bytes(llm.config) * llm.config.tensor_parallel_size
                 / 2**30,
                 "max_num_batched_tokens": llm.config.max_num_batched_tokens,
                 "outputs_digest": hashlib.sha256(repr(outputs).encode()).hexdigest()[:16],
                 "output_lens": [len(ids) for ids in outputs],
                 **{key: value for key, value in stats.items() if key != "replicas"}}
    if requests.ignore_eos and tokens != sum(requests.max_tokens):
        raise RuntimeError(f"nanovllm produced {tokens} tokens, the requests asked for {sum(requests.max_tokens)}")
    return Served(seconds, tokens, ttft, itl, facts)


def save_json(result: dict, path: str | None) -> dict:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def micro(args: argparse.Namespace, device: str) -> dict:
    """--attention-micro: decode attention us per call for each backend (see `benchmarks.attention`)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(config_dir(args.model) if args.model else args.config)
    dtype = resolve_dtype(args.dtype, device, cfg)
    block_size = args.kvcache_block_size or default_block_size(device)
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




def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    return run(parse_args(argv, prog))


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark `options.parse_args` describes; print the report and return the results."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.baseline == "llamacpp":
        return save_json(compare_with_llamacpp(args), args.json)
    try:
        device = resolve_device(args.device)
        if not (args.attention_micro or args.structured):
            resolve_workload(args, device)
    except ValueError as e:
        sys.exit(f"bench.py: error: {e}")
    if args.attention_micro:
        return micro(args, device)
    if args.host_overhead:
        return host(args)
    if args.structured:
        from benchmarks.structured import run_structured

        return save_json(run_structured(args), args.json)
    with model_under_test(args) as (model_dir, baseline_dir, load_format, model_name):
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(config_dir(model_dir))
        requests = make_requests(args, cfg.vocab_size, config_dir(model_dir))
        dtype = resolve_dtype(args.dtype, device, cfg)
        # before any run: its imports must not count in the first run's memory
        num_params = count_parameters(config_dir(model_dir))
        runs, baseline_runs = measure(args, device, dtype, cfg, model_dir, baseline_dir, load_format, requests)
        rows, probe_low = make_rows(args, runs, baseline_runs, cfg, requests, model_name, device)
    facts = next(iter(runs.values()))[0].served.facts
    probes = [m.probe for measured in [*runs.values(), *baseline_runs.values()] for m in measured]
    result = {
        "workload": {"num_seqs": args.num_seqs, "input_len": [args.min_input_len, args.max_input_len],
                     "output_len": [args.min_output_len, args.max_output_len], "prompt_tokens": requests.prompt_tokens,
                     "temperature": args.temperature, "seed": args.seed, "hf_batch_size": args.hf_batch_size,
                     "request_rate": args.request_rate},
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
    return save_json(result, args.json)


def host(args: argparse.Namespace) -> dict:
    """--host-overhead: host milliseconds per decode step (see `benchmarks.host`)."""
    from benchmarks.host import host_overhead

    result = host_overhead(args.host_batch)
    print(markdown_table(["decode batch", "host ms per step, generate()", "host ms per step, step()",
                          "model ms per step"],
                         [[str(result["batch"]), f"{result['generate_ms']:.2f}", f"{result['step_ms']:.2f}",
                           f"{result['model_ms']:.2f}"]]))
    return save_json(result, args.json)


@contextmanager
def model_under_test(args: argparse.Namespace) -> Iterator[tuple[str, str, str, str]]:
    """(model, the baseline's model directory, load format, name): `--model`, or `--config` in a temporary directory
    with dummy weights (random real ones when transformers is the baseline, so both engines run the same weights).
    A GGUF file runs as it is in nanovllm; transformers and vLLM get it converted to a float32 directory."""
    if args.model:
        name, gguf = Path(os.path.normpath(args.model)).name.removesuffix(".gguf"), find_gguf(args.model)
        if not gguf or args.baseline not in ("hf", "vllm"):
            yield args.model, args.model, "auto", name
            return
        with tempfile.TemporaryDirectory(prefix="nanovllm-bench-") as tmp:
            print(f"converting {gguf} to float32 for the {args.baseline} baseline ...", file=sys.stderr)
            convert_gguf(gguf, tmp)
            yield args.model, tmp, "auto", name
        return
    with tempfile.TemporaryDirectory(prefix="nanovllm-bench-") as tmp:
        shutil.copy(args.config, os.path.join(tmp, "config.json"))
        load_format = "dummy"
        if args.baseline == "hf":
            print("writing a random checkpoint for both engines ...", file=sys.stderr)
            write_random_checkpoint(args.config, tmp, args.seed)
            load_format = "auto"
        yield tmp, tmp, load_format, Path(args.config).stem + " (random)"


Key = tuple[str, str, str, bool, str | None]  # attention backend, scheduling, sampling, busy machine, speculative


def measure(args: argparse.Namespace, device: str, dtype: torch.dtype, cfg, model_dir: str, baseline_dir: str,
            load_format: str, requests: Requests) -> tuple[dict[Key, list[Measured]], dict[bool, list[Measured]]]:
    """Every nanovllm row and the baseline, `--repeat` times, interleaved (every row, then the baseline, again), each
    condition (quiet, and busy with `--compete`) in turn."""
    names = attention_backends(args.attention_backend, cfg, device, dtype,
                               args.kvcache_block_size or default_block_size(device))
    vllm_python = find_vllm_python(args.vllm_python, device) if args.baseline == "vllm" else None
    conditions = (False, True) if args.compete else (False,)
    specs = [None] + ([speculation_label(args)] if args.speculative else [])
    runs: dict[Key, list[Measured]] = {key: [] for key in product(names, args.scheduling, args.sampling, conditions,
                                                                  specs)}
    baseline_runs: dict[bool, list[Measured]] = {busy: [] for busy in conditions}
    for _ in range(args.repeat):
        for busy in conditions:
            with competing_process() if busy else nullcontext():
                for name, mode, sampling, spec in product(names, args.scheduling, args.sampling, specs):
                    probe, mem = matmul_peak(device, dtype, seconds=0.5), PeakMemory(device)
                    served = run_engine(model_dir, load_format, requests, args, mem, sampling,
                                        attention_backend=name, enable_chunked_prefill=SCHEDULING[mode],
                                        speculative_config=speculative_config(args) if spec else None)
                    runs[name, mode, sampling, busy, spec].append(Measured(served.seconds, served.tokens, probe,
                                                                           mem.gib, served))
                    gc.collect()
                if args.baseline != "none":
                    baseline_runs[busy].append(run_baseline(args, device, dtype, baseline_dir, load_format, requests,
                                                            vllm_python))
    return runs, baseline_runs


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


def make_rows(args: argparse.Namespace, runs: dict[Key, list[Measured]], baseline_runs: dict[bool, list[Measured]],
              cfg, requests: Requests, model_name: str, device: str) -> tuple[list[Row], list[str]]:
    """One row per nanovllm configuration and condition (its median run), then the condition's baseline; ratios
    within one condition, against its baseline, else its first row. Also the rows whose matmul probe read below the
    rate they achieved (their MFU is capped at 100%)."""
    dtype_name = next(iter(runs.values()))[0].served.facts["dtype"]
    prompt_lens = [len(p) for p in requests.prompts]
    dp = f", {args.data_parallel_size} replicas" if args.data_parallel_size > 1 else ""
    rows, probe_low = [], []
    for busy, baseline_measured in baseline_runs.items():
        start = len(rows)
        for (_, mode, sampling, _, spec), measured in ((k, v) for k, v in runs.items() if k[3] == busy):
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
            rows.append(Row(m.engine[0] + BUSY * busy, m.engine[1], model_name, device, dtype_name,
                            len(requests.prompts), m.tokens, m.seconds, m.tokens / m.seconds, None, row_mfu,
                            m.peak_mem_gib))
            probe_low += [rows[-1].engine] if low else []
        group = rows[start:]
        baseline = group[-1] if baseline_measured else group[0] if len(group) > 1 else None
        for row in group if baseline else []:
            row.ratio = row.tokens_per_s / baseline.tokens_per_s
    return rows, probe_low


if __name__ == "__main__":
    main()
