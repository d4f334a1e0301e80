"""The `--weights-update` mode: an RL loop's policy update, `LLM.load_weights`, against reading and copying the
same state dict in the same process.

Each round generates 32 rollouts (`--num-seqs`; chat prompts, temperature 1, `--max-output-len` or 32 tokens), makes
a changed state dict (every tensor scaled by its own factor), then times, one after another: a read of the state dict
(a sum over every tensor), a copy of it (`clone`), and `load_weights` of it (which writes every weight in place and
resets the prefix cache). The state dict is the model's own float32 tensors, as a trainer holding float32 weights
would send them (`--dtype` picks the engine's; the default model's GGUF file is dequantized to a float32 directory
first, which the engine loads). Reported: the median over rounds after the first, which also pays for first-touch
allocation.
"""
import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.chat import chat_prompts
from benchmarks.machine import bench_device
from benchmarks.model import structured_weights
from benchmarks.report import markdown_table
from nanovllm import LLM, SamplingParams, default_model


def run(args: argparse.Namespace) -> dict:
    """--weights-update: the table of rollouts, update, read and copy times, printed; the figures returned."""
    device = bench_device(args.device)
    rounds = max(args.repeat, 2) + 1
    with structured_weights(args.model or default_model(), "vllm") as (model, weights, _):
        state = {name: tensor for file in sorted(safetensors_files(model)) for name, tensor in load_file(file).items()}
        with LLM(model, device=device, dtype=args.dtype) as llm:
            dtype = str(llm.config.torch_dtype).removeprefix("torch.")
            prompts = [{"prompt_token_ids": ids} for ids in chat_prompts(llm.get_tokenizer(), args.num_seqs or 32)]
            params = SamplingParams(temperature=1.0, max_tokens=args.max_output_len or 32, seed=args.seed)
            times: dict[str, list[float]] = {}
            for number in range(rounds):
                timed(times, "rollouts", lambda: llm.generate(prompts, params, use_tqdm=False))
                update(llm, {name: tensor * (1 + 1e-3 * (number + 1)) for name, tensor in state.items()}, times)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    median = {what: statistics.median(seconds[1:]) for what, seconds in times.items()}
    result = {"model": weights, "dtype": dtype, "state_dict_bytes": nbytes, "seconds": median, "rounds": times,
              "update_per_read": median["update"] / median["read"],
              "update_per_copy": median["update"] / median["copy"]}
    print(f"\n{len(prompts)} rollouts per round, {weights}, engine dtype {dtype}, a float32 state dict of "
          f"{nbytes / 1e6:.0f} MB, median of {rounds - 1} rounds after the first")
    print(markdown_table(["rollouts s", "update ms", "read ms", "copy ms", "update / read", "update / copy"],
                         [[f"{median['rollouts']:.2f}", f"{median['update'] * 1e3:.1f}", f"{median['read'] * 1e3:.1f}",
                           f"{median['copy'] * 1e3:.1f}", f"{result['update_per_read']:.2f}x",
                           f"{result['update_per_copy']:.2f}x"]]))
    return result


def update(llm: LLM, changed: dict[str, torch.Tensor], times: dict[str, list[float]]) -> None:
    """One policy update, timed beside a read and a copy of the same state dict."""
    timed(times, "read", lambda: sum(float(t.sum()) for t in changed.values()))
    timed(times, "copy", lambda: {name: t.clone() for name, t in changed.items()})
    timed(times, "update", lambda: llm.load_weights(changed.items()))


def timed(times: dict[str, list[float]], what: str, work: Callable[[], object]) -> None:
    start = time.perf_counter()
    work()
    times.setdefault(what, []).append(time.perf_counter() - start)


def safetensors_files(model: str) -> list[str]:
    files = [str(path) for path in Path(model).glob("*.safetensors")]
    if not files:
        raise SystemExit(f"bench.py: error: --weights-update reads the model's safetensors files; {model} has none")
    return files
