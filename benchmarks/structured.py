"""The `--structured` mode: structured outputs' cost on a JSON-schema extraction workload, with the default model.

Each row is one grammar backend: constrained tok/s (32 requests of 8 schema shapes, greedy, submitted at once, their
grammars compiled in the run: each round's schemas carry a `$comment` of their own, `fresh_constraint`, so no
engine's cache of compiled grammars has them), beside the same prompts unconstrained, each request run to the length
its constrained output had (`ignore_eos`), so both runs compute the same tokens; then the time of a one-token request
with a schema never seen before, against one without; then how many outputs of a varied set (schemas, regexes,
choices, a grammar; greedy and sampled) satisfy their constraint. `--baseline vllm` runs vLLM on the same requests
(`vllm_structured_runner.py`, in vLLM's own python), round by round with nanovllm's (`--repeat` rounds), so both see
the same load.

What makes the two engines' figures comparable: with `--baseline vllm` a GGUF model (the default one) is dequantized
into a float32 directory that both engines load, in the same dtype, so they compute with the same weights (nanovllm
also runs the file as it is, a row of its own: what its users run, and vLLM's CPU build cannot); every
timed run has prompts of its own (the documents are labelled per run), so neither engine's prefix cache carries
one run's prompts into the next, and the time to first token is that of a prompt no run has seen. Within a run, the
prompts of one schema share their opening (chat template, instruction, schema: 124 to 221 tokens), which each engine's
prefix cache reuses in whole blocks: vLLM's CPU build 128 tokens at a time, nanovllm 16 (its CPU default).

It drives nanovllm through the public API only (`LLM`, its `config` and `chat_prompt`, `SamplingParams`,
`StructuredOutputsParams`, `nanovllm.default_model`); the GGUF conversion for the vLLM baseline is `benchmarks.model`'s.
"""
import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.baselines import find_vllm_python, run_vllm_runner
from benchmarks.machine import bench_device
from benchmarks.model import structured_weights
from benchmarks.report import markdown_table
from benchmarks.structured_workload import (
    FRESH,
    Case,
    Workload,
    constrained,
    fresh_schema,
    json_cases,
    varied_cases,
    warmup_prompts,
)
from nanovllm import LLM, SamplingParams, default_model


def run(args: argparse.Namespace) -> dict:
    """--structured: the table of every engine's figures, printed; the figures returned."""
    device = bench_device(args.device)
    given = args.model or default_model()
    count = args.num_seqs or len(json_cases())
    checks = varied_cases()
    max_tokens = args.max_output_len or 384
    result = {"model": given, "num_requests": count, "max_tokens": max_tokens, "engines": {}}
    with structured_weights(given, args.baseline) as (model, weights, as_is), ExitStack() as stack:
        engines = {f"nanovllm ({backend})": (model, backend) for backend in args.structured_backend}
        if as_is:
            engines |= {f"nanovllm ({backend}), {Path(as_is).name} as is": (as_is, backend)
                        for backend in args.structured_backend}
        llms = {name: stack.enter_context(LLM(path, device=device, dtype=args.dtype,
                                              structured_outputs_config={"backend": backend}))
                for name, (path, backend) in engines.items()}
        llm = next(iter(llms.values()))
        dtype = str(llm.config.torch_dtype).removeprefix("torch.")
        workload = Workload.make(llm, count, checks, max_tokens, args.repeat)
        vllm_python = find_vllm_python(args.vllm_python, "cpu") if args.baseline == "vllm" else None
        rounds: dict[str, list[dict]] = {}
        for number in range(args.repeat):
            for name, engine in llms.items():
                rounds.setdefault(name, []).append(measure(engine, workload, number))
            if vllm_python:
                figures = run_vllm(vllm_python, model, workload, number, dtype)
                rounds.setdefault(figures.pop("engine"), []).append(figures)
    rows = []
    for name, measured in rounds.items():
        figures = combine(measured, checks)
        result["engines"][name] = figures
        rows.append(row(name, figures))
    if vllm_python:
        theirs = result["engines"][rows[-1][0]]["tokens_per_s"]["constrained"]
        for name in llms:
            print(f"{name} / {rows[-1][0]}, constrained tok/s: "
                  f"{result['engines'][name]['tokens_per_s']['constrained'] / theirs:.2f}x")
    print(f"\n{count} JSON-schema requests (8 shapes), greedy, up to {max_tokens} tokens, {weights}, {dtype}, "
          f"{args.repeat} round(s) per figure, engines in turn (median); TTFT: one-token request alone, a prompt no "
          f"run has seen, median of {FRESH} per round; valid: outputs of {len(checks)} varied constraints, greedy and "
          "sampled; load: the 1-minute load average at each engine's start and end of a round")
    print(markdown_table(["engine", "constrained tok/s", "unconstrained tok/s", "ratio", "TTFT fresh schema ms",
                          "TTFT unconstrained ms", "valid", "load"], rows))
    return result


def measure(llm: LLM, work: Workload, number: int) -> dict:
    """One round of nanovllm's figures (the validity checks in the first round only)."""
    def timed(prompts, params):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    load = [os.getloadavg()[0]]
    prompts = work.rounds[number]
    timed(warmup_prompts(prompts["constrained"]), SamplingParams(temperature=0, max_tokens=4))
    seconds, outputs = timed(prompts["constrained"], [constrained(c, f"round {number}", temperature=0,
                                                                  max_tokens=work.max_tokens) for c in work.cases])
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    figures = {"tokens_per_s": {"constrained": sum(lengths) / seconds}, "texts": [o.outputs[0].text for o in outputs]}
    seconds, outputs = timed(prompts["unconstrained"], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                        for n in lengths])
    figures["tokens_per_s"]["unconstrained"] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
    ttft = {"fresh_schema": [], "unconstrained": []}
    fresh = work.ttft[2 * FRESH * number:2 * FRESH * (number + 1)]
    for i in range(FRESH):
        schema = Case("", {"json": fresh_schema(FRESH * number + i)})
        ttft["fresh_schema"].append(timed([fresh[2 * i]], constrained(schema, temperature=0, max_tokens=1))[0])
        ttft["unconstrained"].append(timed([fresh[2 * i + 1]], SamplingParams(temperature=0, max_tokens=1))[0])
    figures["ttft_s"] = {k: statistics.median(v) for k, v in ttft.items()}
    figures["checks"] = {}
    if number == 0:
        for name, settings in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 0})):
            outputs = llm.generate(work.check_prompts, [constrained(c, max_tokens=work.max_tokens, **settings)
                                                        for c in work.checks], use_tqdm=False)
            figures["checks"][name] = [o.outputs[0].text for o in outputs]
    figures["load"] = [*load, os.getloadavg()[0]]
    return figures


def combine(rounds: list[dict], checks: list[Case]) -> dict:
    """An engine's figures over its rounds: medians, the first round's outputs and checks, every round's load."""
    return {"tokens_per_s": {k: statistics.median(r["tokens_per_s"][k] for r in rounds)
                             for k in ("constrained", "unconstrained")},
            "ttft_s": {k: statistics.median(r["ttft_s"][k] for r in rounds) for k in ("fresh_schema", "unconstrained")},
            "rounds": [{k: r[k] for k in ("tokens_per_s", "ttft_s", "load")} for r in rounds],
            "texts": rounds[0]["texts"], **validity(checks, rounds[0]["checks"])}


def row(name: str, figures: dict) -> list[str]:
    tps, ttft = figures["tokens_per_s"], figures["ttft_s"]
    load = [x for r in figures["rounds"] for x in r["load"]]
    return [name, f"{tps['constrained']:.1f}", f"{tps['unconstrained']:.1f}",
            f"{tps['constrained'] / tps['unconstrained']:.2f}x", f"{ttft['fresh_schema'] * 1e3:.1f}",
            f"{ttft['unconstrained'] * 1e3:.1f}", f"{figures['valid']} of {figures['checked']}",
            f"{min(load):.1f}-{max(load):.1f}"]


def validity(checks: list[Case], texts: dict[str, list[str]]) -> dict:
    """How many outputs satisfy their constraint, and the ones that do not."""
    invalid = [{"sampling": name, "constraint": json.dumps(case.constraint)[:80], "text": text, "problem": problem}
               for name, outputs in texts.items() for case, text in zip(checks, outputs)
               if (problem := case.problem(text)) is not None]
    checked = sum(map(len, texts.values()))
    for bad in invalid:
        print(f"invalid ({bad['sampling']}): {bad['problem']}: {bad['text'][:120]!r}", file=sys.stderr)
    return {"checked": checked, "valid": checked - len(invalid), "invalid": invalid}


def run_vllm(python: str, model: str, work: Workload, number: int, dtype: str) -> dict:
    """One round of vLLM's figures, in a process of its own (the validity checks in the first round only)."""
    fresh = work.ttft[2 * FRESH * number:2 * FRESH * (number + 1)]
    print(f"vLLM, round {number + 1} ...", file=sys.stderr)
    return run_vllm_runner(
        python, "vllm_structured_runner.py", model,
        {"prompts": work.rounds[number], "warmup": warmup_prompts(work.rounds[number]["constrained"]),
         "constraints": [c.constraint for c in work.cases], "max_tokens": work.max_tokens,
         "ttft": {"prompts": fresh, "schemas": [fresh_schema(100 + FRESH * number + i) for i in range(FRESH)]},
         "checks": {"prompts": work.check_prompts if number == 0 else [],
                    "constraints": [c.constraint for c in work.checks]}},
        "--dtype", dtype)
