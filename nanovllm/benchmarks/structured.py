"""`bench.py --structured`: structured outputs' cost on a JSON-schema extraction workload, with the default model.

Each row is one grammar backend: constrained tok/s (32 requests of 8 schema shapes, greedy, submitted at once, their
grammars compiled in the run), beside the same prompts unconstrained, each request run to the length its constrained
output had (`ignore_eos`), so both runs compute the same tokens; then the time of a one-token request with a schema
never seen before, against one without; then how many outputs of a varied set (schemas, regexes, choices, a grammar;
greedy and sampled) satisfy their constraint. `--baseline vllm` runs vLLM on the same requests
(`vllm_structured_runner.py`, in vLLM's own python).
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.benchmarks.baselines import find_vllm_python
from nanovllm.benchmarks.report import markdown_table
from nanovllm.benchmarks.structured_jump import JUMP_FORWARD_HEADER, compare_jump_forward, jump_forward_row
from nanovllm.benchmarks.structured_workload import Case, fresh_schema, json_cases, varied_cases

FRESH = 5  # one-token requests with a fresh schema (and as many without), interleaved


def constrained(case: Case, **settings) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(**case.constraint), **settings)


def run_structured(args: argparse.Namespace) -> dict:
    from nanovllm.smollm2 import default_model

    model = args.model or default_model()
    cases = json_cases()
    cases = [cases[i % len(cases)] for i in range(args.num_seqs or len(cases))]
    checks = varied_cases()
    max_tokens = args.max_output_len or 384
    rows, result = [], {"model": model, "num_requests": len(cases), "max_tokens": max_tokens, "engines": {}}
    for backend in args.structured_backend:
        with LLM(model, device=args.device, dtype=args.dtype, structured_outputs_config={"backend": backend}) as llm:
            prompts = [llm.chat_prompt([{"role": "user", "content": c.message}]) for c in cases]
            check_prompts = [llm.chat_prompt([{"role": "user", "content": c.message}]) for c in checks]
            dtype = str(llm.config.torch_dtype).removeprefix("torch.")
            if args.jump_forward_compare:
                figures = {"jump_forward": compare_jump_forward(
                    llm, prompts, [constrained(c, temperature=0, max_tokens=max_tokens) for c in cases], args.repeat)}
            else:
                figures = measure(llm, cases, prompts, check_prompts, checks, max_tokens, args.repeat)
        result["engines"][f"nanovllm ({backend})"] = figures
        rows.append(jump_forward_row(f"nanovllm, {backend}", figures["jump_forward"]) if args.jump_forward_compare
                    else row(f"nanovllm, {backend}", figures))
    if args.jump_forward_compare:
        print(f"\n{len(cases)} JSON-schema requests (8 shapes), greedy, up to {max_tokens} tokens, "
              f"{model.split('/')[-1]}, {dtype}, jump-forward off and on interleaved in one engine, {args.repeat} "
              "run(s) each (median); steps/token: forward passes per completion token")
        print(markdown_table(JUMP_FORWARD_HEADER, rows))
        return result
    if args.baseline == "vllm":
        figures = run_vllm(find_vllm_python(args.vllm_python, "cpu"), model, prompts, cases, check_prompts, checks,
                           max_tokens, args.repeat, dtype)
        result["engines"][figures["engine"]] = figures
        rows.append(row(figures["engine"], figures))
        ours = rows[0][1]
        print(f"\nnanovllm ({args.structured_backend[0]}) / {figures['engine']}, constrained tok/s: "
              f"{float(ours) / figures['tokens_per_s']['constrained']:.2f}x")
    print(f"\n{len(cases)} JSON-schema requests (8 shapes), greedy, up to {max_tokens} tokens, {model.split('/')[-1]}, "
          f"{dtype}, {args.repeat} run(s) per figure (median); TTFT: one-token request alone, median of {FRESH}; "
          f"valid: outputs of {len(checks)} varied constraints, greedy and sampled")
    print(markdown_table(["engine", "constrained tok/s", "unconstrained tok/s", "ratio", "TTFT fresh schema ms",
                          "TTFT unconstrained ms", "valid"], rows))
    return result


def row(name: str, figures: dict) -> list[str]:
    tps, ttft = figures["tokens_per_s"], figures["ttft_s"]
    return [name, f"{tps['constrained']:.1f}", f"{tps['unconstrained']:.1f}",
            f"{tps['constrained'] / tps['unconstrained']:.2f}x", f"{ttft['fresh_schema'] * 1e3:.1f}",
            f"{ttft['unconstrained'] * 1e3:.1f}", f"{figures['valid']} of {figures['checked']}"]


def measure(llm: LLM, cases: list[Case], prompts: list[list[int]], check_prompts: list[list[int]],
            checks: list[Case], max_tokens: int, repeat: int) -> dict:
    def timed(prompts, params):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    timed(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
    runs = {"constrained": [], "unconstrained": []}
    for _ in range(repeat):
        llm.structured.clear_cache()
        seconds, outputs = timed(prompts, [constrained(c, temperature=0, max_tokens=max_tokens) for c in cases])
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        texts = [o.outputs[0].text for o in outputs]
        runs["constrained"].append(sum(lengths) / seconds)
        seconds, outputs = timed(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                           for n in lengths])
        runs["unconstrained"].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
    ttft = {"fresh_schema": [], "unconstrained": []}
    for i in range(FRESH):
        fresh = Case("", {"json": fresh_schema(i)})
        ttft["fresh_schema"].append(timed(prompts[:1], constrained(fresh, temperature=0, max_tokens=1))[0])
        ttft["unconstrained"].append(timed(prompts[:1], SamplingParams(temperature=0, max_tokens=1))[0])
    check_texts = {}
    for name, settings in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 0})):
        outputs = llm.generate(check_prompts, [constrained(c, max_tokens=max_tokens, **settings) for c in checks],
                               use_tqdm=False)
        check_texts[name] = [o.outputs[0].text for o in outputs]
    return {"tokens_per_s": {k: statistics.median(v) for k, v in runs.items()},
            "ttft_s": {k: statistics.median(v) for k, v in ttft.items()}, "texts": texts,
            **validity(checks, check_texts)}


def validity(checks: list[Case], texts: dict[str, list[str]]) -> dict:
    """How many outputs satisfy their constraint, and the ones that do not."""
    invalid = [{"sampling": name, "constraint": json.dumps(case.constraint)[:80], "text": text, "problem": problem}
               for name, outputs in texts.items() for case, text in zip(checks, outputs)
               if (problem := case.problem(text)) is not None]
    checked = sum(map(len, texts.values()))
    for bad in invalid:
        print(f"invalid ({bad['sampling']}): {bad['problem']}: {bad['text'][:120]!r}", file=sys.stderr)
    return {"checked": checked, "valid": checked - len(invalid), "invalid": invalid}


def run_vllm(python: str, model: str, prompts: list[list[int]], cases: list[Case], check_prompts: list[list[int]],
             checks: list[Case], max_tokens: int, repeat: int, dtype: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"prompts": prompts, "constraints": [c.constraint for c in cases], "max_tokens": max_tokens,
                   "repeat": repeat, "fresh_schemas": [fresh_schema(100 + i) for i in range(FRESH)],
                   "checks": {"prompts": check_prompts, "constraints": [c.constraint for c in checks]}}, f)
        f.flush()
        print("vLLM ...", file=sys.stderr)
        done = subprocess.run([python, str(Path(__file__).with_name("vllm_structured_runner.py")), model, f.name,
                               "--dtype", dtype], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"vLLM failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"engine"')]
    if not lines:
        raise RuntimeError(f"vLLM printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    figures = json.loads(lines[-1])
    return {**figures, **validity(checks, figures.pop("checks"))}
