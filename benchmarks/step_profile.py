"""Where a batch-1 decode step goes: one request (a random prompt, greedy, `ignore_eos`) decoded by the engine as
configured (decode steps in one C++ call where the model allows, `nanovllm.execution.cpu_decode`) and with
`enforce_eager=True` (layer by layer), rounds interleaved in one process; per step, the median over rounds of the
wall time of each piece: the scheduler and output building (engine), the batch's tensors (prepare), the embedding,
the layers and final norm, the LM head, the sampler.

    python -m benchmarks.step_profile --model SmolLM2-135M-Instruct.Q4_1.gguf --threads 2
"""
import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks.report import markdown_table
from nanovllm import LLM, SamplingParams

PIECES = ("engine", "prepare", "embedding", "layers", "LM head", "sampler", "runner glue")


class Timed:
    """`target` (a callable) with its calls' wall time added to `seconds[name]`; its attributes passed through."""

    def __init__(self, target: Callable, name: str, seconds: dict[str, float]):
        self.target, self.name, self.seconds = target, name, seconds

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.target(*args, **kwargs)
        finally:
            self.seconds[self.name] += time.perf_counter() - start

    def __getattr__(self, attr: str):
        return getattr(self.target, attr)


def instrument(llm: LLM) -> dict[str, float]:
    """Time the pieces of `llm`'s steps into the returned dict (seconds, summed over calls)."""
    seconds: dict[str, float] = defaultdict(float)
    runner = llm.engine.model_runner
    model = runner.model
    model.model.embed = Timed(model.model.embed, "embedding", seconds)
    model.forward = Timed(model.forward, "model", seconds)
    if runner.cpu_decoder is not None:
        runner.cpu_decoder = Timed(runner.cpu_decoder, "model", seconds)
    model.compute_logits = Timed(model.compute_logits, "LM head", seconds)
    runner.sampler = Timed(runner.sampler, "sampler", seconds)
    runner.prepare = Timed(runner.prepare, "prepare", seconds)
    runner.run = Timed(runner.run, "runner", seconds)
    return seconds


def decode_round(llm: LLM, seconds: dict[str, float], prompt: list[int], output_tokens: int) -> dict[str, float]:
    """Milliseconds per decode step of each piece, and of the whole step ("step")."""
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True))
    llm.step()  # the prompt
    seconds.clear()
    start, steps = time.perf_counter(), 0
    while not llm.is_finished():
        llm.step()
        steps += 1
    total = time.perf_counter() - start
    ms = {name: 1000 * value / steps for name, value in seconds.items()}
    ms["layers"] = ms.pop("model") - ms["embedding"]
    ms["runner glue"] = ms.pop("runner") - sum(ms[p] for p in ("prepare", "embedding", "layers", "LM head", "sampler"))
    ms["step"] = 1000 * total / steps
    ms["engine"] = ms["step"] - sum(ms[p] for p in PIECES if p != "engine")
    return ms


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory or .gguf file")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()  # the engines' thread governor may lower it on a busy machine
    settings = dict(device="cpu", dtype=args.dtype, max_num_seqs=8, max_model_len=args.prompt_tokens +
                    args.output_tokens)
    engines = {"one call": LLM(args.model, **settings), "layer by layer": LLM(args.model, enforce_eager=True,
                                                                              **settings)}
    clocks = {name: instrument(llm) for name, llm in engines.items()}
    vocab, rng = engines["one call"].config.hf_config.vocab_size, random.Random(0)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for i in range(args.rounds + 1):  # the first round warms up
        for name, llm in engines.items():
            result = decode_round(llm, clocks[name], [rng.randrange(vocab) for _ in range(args.prompt_tokens)],
                                  args.output_tokens)
            if i:
                rounds[name].append(result)
    medians = {name: {piece: statistics.median(r[piece] for r in results) for piece in (*PIECES, "step")}
               for name, results in rounds.items()}
    print(f"batch-1 decode, {threads} threads, ms per step (median of {args.rounds} rounds; "
          f"{'one call' if engines['one call'].engine.model_runner.cpu_decoder is not None else 'no one-call path'} "
          "for this model)")
    print(markdown_table(["piece", *engines], [[piece, *(f"{medians[name][piece]:.3f}" for name in engines)]
                                               for piece in (*PIECES, "step")]))
    for llm in engines.values():
        llm.exit()
    return medians


if __name__ == "__main__":
    main()
