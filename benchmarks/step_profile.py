"""Where a batch-1 decode step goes: one request (a random prompt, greedy, `ignore_eos`) decoded by the engine as
configured (decode steps in one C++ call where the model allows, `nanovllm.execution.cpu_decode`) and with
`enforce_eager=True` (layer by layer), rounds interleaved in one process; per step, the median over rounds of the
wall time of each piece, as the engine's profiling hook (`llm.engine.model_runner.phase_seconds`, the one this
package documents) times its phases: the batch's tensors (prepare), the model (embedding, layers and final norm), the
LM head, the sampler; and the rest of the step (engine): the scheduler, the runner's glue, appending tokens and
building outputs.

With `--verify K`, a third engine speculates by n-gram lookup (K drafts) over a prompt that repeats a random run of
tokens (a model continues such a prompt by copying it, so most drafts are kept): each of its decode steps is timed
whole and filed by the drafts it verified (`LLM.stats()`), and the median step verifying K drafts is given against
the median plain step of the first engine: what issue 38 calls "a step verifying 5 drafts, in plain steps".

    python -m benchmarks.step_profile --model SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 [--verify 5]
"""
import argparse
import random
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.report import markdown_table
from nanovllm import LLM, SamplingParams

PIECES = ("engine", "prepare", "model", "LM head", "sampler")
PHASES = {"prepare": "prepare", "model": "model", "lm_head": "LM head", "sampler": "sampler", "draft": "draft"}


def start_request(llm: LLM, prompt: list[int], output_tokens: int) -> None:
    """Submit one greedy request and run its prompt, in as many steps as the token budget takes, up to its first
    token: the steps after it decode."""
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True))
    while not llm.step():
        pass


def decode_round(llm: LLM, prompt: list[int], output_tokens: int) -> dict[str, float]:
    """Milliseconds per decode step of each piece, and of the whole step ("step")."""
    phases: dict[str, float] = {}
    start_request(llm, prompt, output_tokens)
    llm.engine.model_runner.phase_seconds = phases  # the documented profiling hook: from the first decode step on
    start, steps = time.perf_counter(), 0
    while not llm.is_finished():
        llm.step()
        steps += 1
    total = time.perf_counter() - start
    llm.engine.model_runner.phase_seconds = None
    ms = {PHASES[phase]: 1000 * value / steps for phase, value in phases.items()}
    ms["step"] = 1000 * total / steps
    ms["engine"] = ms["step"] - sum(value for piece, value in ms.items() if piece != "step")
    return ms


def verify_round(llm: LLM, prompt: list[int], output_tokens: int) -> dict[int, list[float]]:
    """Milliseconds of each decode step, by how many drafts it verified."""
    start_request(llm, prompt, output_tokens)
    steps: dict[int, list[float]] = defaultdict(list)
    while not llm.is_finished():
        drafts = llm.stats()["num_draft_tokens"]
        start = time.perf_counter()
        llm.step()
        elapsed = 1000 * (time.perf_counter() - start)
        steps[llm.stats()["num_draft_tokens"] - drafts].append(elapsed)
    return steps


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory or .gguf file")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="also time steps verifying K drafts (n-gram speculation) against plain steps")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()  # the engines' thread governor may lower it on a busy machine
    settings = dict(device="cpu", dtype=args.dtype, max_num_seqs=8, max_model_len=args.prompt_tokens +
                    args.output_tokens)
    engines = {"one call": LLM(args.model, **settings), "layer by layer": LLM(args.model, enforce_eager=True,
                                                                              **settings)}
    speculating = LLM(args.model, speculative_config={"method": "ngram", "num_speculative_tokens": args.verify},
                      **settings) if args.verify else None
    vocab, rng = engines["one call"].config.hf_config.vocab_size, random.Random(0)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    verify_steps: dict[int, list[float]] = defaultdict(list)
    for i in range(args.rounds + 1):  # the first round warms up
        for name, llm in engines.items():
            result = decode_round(llm, [rng.randrange(vocab) for _ in range(args.prompt_tokens)],
                                  args.output_tokens)
            if i:
                rounds[name].append(result)
        if speculating is not None:
            run = [rng.randrange(vocab) for _ in range(args.prompt_tokens // 2)]
            steps = verify_round(speculating, run + run, args.output_tokens)
            if i:
                for drafts, times in steps.items():
                    verify_steps[drafts] += times
    medians = {name: {piece: statistics.median(r.get(piece, 0.0) for r in results) for piece in (*PIECES, "step")}
               for name, results in rounds.items()}
    print(f"batch-1 decode, {threads} threads, ms per step (median of {args.rounds} rounds; the first engine decodes "
          "in one call where the model allows)")
    print(markdown_table(["piece", *engines], [[piece, *(f"{medians[name][piece]:.3f}" for name in engines)]
                                               for piece in (*PIECES, "step")]))
    if speculating is not None:
        plain = medians["one call"]["step"]
        medians["verify"] = {f"{drafts} drafts": statistics.median(times) for drafts, times in verify_steps.items()}
        print(f"n-gram speculation ({args.verify} drafts at most), ms per decode step by the drafts it verified "
              f"(median), and in plain steps ({plain:.3f} ms, the first engine's)")
        print(markdown_table(["drafts verified", "steps", "ms per step", "plain steps"],
                             [[str(drafts), str(len(times)), f"{statistics.median(times):.3f}",
                               f"{statistics.median(times) / plain:.2f}"]
                              for drafts, times in sorted(verify_steps.items())]))
        speculating.exit()
    for llm in engines.values():
        llm.exit()
    return medians


if __name__ == "__main__":
    main()
