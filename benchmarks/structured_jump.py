"""The `--structured --jump-forward-compare` mode: what exact jump-forward saves on the JSON-schema workload.

Two engines on the same model, `structured_outputs_config={"jump_forward": False}` and `True`, each warmed up on a
batch as large as the timed ones, run the constrained requests (greedy, submitted at once) in turn (off, on, off, on,
...), each run compiling its grammars afresh (its schemas carry a `$comment` of their own, `fresh_constraint`):
forward passes (engine steps) per completion token of the whole batch; a request's decode passes per token of its own
(each of its steps yields its accepted drafts and one token more: 1 - accepted / tokens); tok/s; the forced drafts'
acceptance; and whether the outputs are token-identical (they must be). All of it from the public API: `LLM`,
`SamplingParams` and `stats()` (the step and draft counters).
"""
import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.machine import bench_device
from benchmarks.report import markdown_table
from benchmarks.structured_workload import Case, Workload, constrained, json_cases, varied_cases, warmup_prompts
from nanovllm import LLM, SamplingParams, default_model

COUNTERS = ("num_steps", "num_draft_tokens", "num_accepted_tokens")
JUMP_FORWARD_HEADER = ["engine", "steps/token off", "steps/token on", "request passes/token on", "tok/s off",
                       "tok/s on", "on/off", "forced drafts accepted", "identical"]


def run(args: argparse.Namespace) -> dict:
    """Each `--structured-backend` in turn: its pair of engines compared; prints the table, returns the figures."""
    device = bench_device(args.device)
    model = args.model or default_model()
    count = args.num_seqs or len(json_cases())
    max_tokens = args.max_output_len or 384
    result = {"model": model, "num_requests": count, "max_tokens": max_tokens, "engines": {}}
    rows, workload, dtype = [], None, None
    for backend in args.structured_backend:
        settings = dict(device=device, dtype=args.dtype)
        with LLM(model, structured_outputs_config={"backend": backend, "jump_forward": False}, **settings) as off, \
                LLM(model, structured_outputs_config={"backend": backend, "jump_forward": True}, **settings) as on:
            if workload is None:
                workload = Workload.make(off, count, varied_cases(), max_tokens, 1)
                dtype = str(off.config.torch_dtype).removeprefix("torch.")
            figures = compare_jump_forward({"off": off, "on": on}, workload.rounds[0]["constrained"],
                                           fresh_params(workload.cases, max_tokens), args.repeat)
        name = f"nanovllm ({backend})"
        result["engines"][name] = {"jump_forward": figures}
        rows.append(jump_forward_row(name, figures))
    print(f"\n{count} JSON-schema requests (8 shapes), greedy, up to {max_tokens} tokens, "
          f"{Path(os.path.normpath(model)).name}, {dtype}, jump-forward off and on in two engines, runs interleaved, "
          f"{args.repeat} run(s) each (median); steps/token: forward passes per completion token")
    print(markdown_table(JUMP_FORWARD_HEADER, rows))
    return result


def fresh_params(cases: list[Case], max_tokens: int) -> Callable[[int], list[SamplingParams]]:
    """Run i's sampling parameters: greedy, each case's constraint labelled with the run (compiled afresh)."""
    return lambda run: [constrained(case, f"run {run}", temperature=0, max_tokens=max_tokens) for case in cases]


def compare_jump_forward(engines: dict[str, LLM], prompts: list[list[int]],
                         params: Callable[[int], list[SamplingParams]], repeat: int) -> dict:
    """`engines["off"]` and `engines["on"]` (jump-forward off and on, otherwise alike) on `prompts`, `repeat` runs each,
    interleaved; run i's sampling parameters are `params(i)`, the same for both engines. The median figures of each
    mode, the last run's draft counts, and whether the last runs' outputs are identical."""
    for llm in engines.values():
        llm.generate(warmup_prompts(prompts), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    runs: dict[str, list[dict]] = {mode: [] for mode in engines}
    outputs: dict[str, list[list[int]]] = {}
    for number in range(repeat):
        run_params = params(number)
        for mode, llm in engines.items():
            before = llm.stats()
            start = time.perf_counter()
            done = llm.generate(prompts, run_params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = llm.stats()
            tokens = sum(len(o.outputs[0].token_ids) for o in done)
            outputs[mode] = [o.outputs[0].token_ids for o in done]
            # without jump-forward (nor a speculative method) the engine counts no drafts
            counts = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
            runs[mode].append({"tokens_per_s": tokens / seconds, "steps_per_token": counts["num_steps"] / tokens,
                               "request_passes_per_token": 1 - counts["num_accepted_tokens"] / tokens, **counts})
    figures = {mode: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                      "steps_per_token": statistics.median(r["steps_per_token"] for r in rs),
                      "request_passes_per_token": statistics.median(r["request_passes_per_token"] for r in rs),
                      "num_draft_tokens": rs[-1]["num_draft_tokens"],
                      "num_accepted_tokens": rs[-1]["num_accepted_tokens"]}
               for mode, rs in runs.items()}
    return {**figures, "identical": outputs["off"] == outputs["on"]}


def jump_forward_row(name: str, figures: dict) -> list[str]:
    off, on = figures["off"], figures["on"]
    drafts = on["num_draft_tokens"]
    accepted = f"{on['num_accepted_tokens']} of {drafts}" if drafts else "none proposed"
    return [name, f"{off['steps_per_token']:.3f}", f"{on['steps_per_token']:.3f}",
            f"{on['request_passes_per_token']:.3f}", f"{off['tokens_per_s']:.1f}",
            f"{on['tokens_per_s']:.1f}", f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x", accepted,
            "yes" if figures["identical"] else "NO"]
