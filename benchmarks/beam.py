"""The `--beam-search` mode: `LLM.beam_search` on chat prompts, against vLLM's on the same requests.

32 one-turn chat prompts (`--num-seqs`; `benchmarks.chat`'s questions through the model's chat template), searched
in one call with `BeamSearchParams(beam_width=--beam-width, max_tokens=--max-output-len or 32)`, greedy scores
(temperature 0), the default model unless `--model`. After a warm-up call on two prompts, each round times one call
over all prompts; with `--baseline vllm`, vLLM's `beam_search` runs the same requests in its own python
(`vllm_beam_runner.py`), round by round with nanovllm's (`--repeat` rounds), and the report says for how many prompts
the two engines' best beams are the same tokens. As in `--structured`, a GGUF model is dequantized into a float32
directory that both engines load, so both search with the same weights.

Figures: seconds per call (median over rounds) and beam tokens per second (every returned beam's generated tokens).
"""
import argparse
import statistics
import sys
import time

from benchmarks.baselines import find_vllm_python, run_vllm_runner
from benchmarks.chat import chat_prompts
from benchmarks.machine import bench_device
from benchmarks.model import structured_weights
from benchmarks.report import markdown_table
from nanovllm import LLM, BeamSearchParams, default_model


def run(args: argparse.Namespace) -> dict:
    """--beam-search: the table of both engines' figures, printed; the figures returned."""
    device = bench_device(args.device)
    width, max_tokens = args.beam_width, args.max_output_len or 32
    with structured_weights(args.model or default_model(), args.baseline) as (model, weights, _):
        vllm_python = find_vllm_python(args.vllm_python, device) if args.baseline == "vllm" else None
        with LLM(model, device=device, dtype=args.dtype) as llm:
            dtype = str(llm.config.torch_dtype).removeprefix("torch.")
            prompts = chat_prompts(llm.get_tokenizer(), args.num_seqs or 32)
            params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
            requests = [{"prompt_token_ids": ids} for ids in prompts]
            llm.beam_search(requests[:2], params)
            rounds: dict[str, list[dict]] = {}
            for _ in range(args.repeat):
                start = time.perf_counter()
                outputs = llm.beam_search(requests, params)
                rounds.setdefault("nanovllm", []).append(
                    {"seconds": time.perf_counter() - start,
                     "beams": [[s.tokens[len(p):] for s in o.sequences] for o, p in zip(outputs, prompts)]})
                if vllm_python:
                    figures = run_vllm(vllm_python, model, prompts, width, max_tokens, dtype)
                    rounds.setdefault(figures.pop("engine"), []).append(figures)
    result = {"model": weights, "dtype": dtype, "num_prompts": len(prompts), "beam_width": width,
              "max_tokens": max_tokens, "engines": {}}
    ours = rounds["nanovllm"][0]["beams"]
    rows = []
    for name, measured in rounds.items():
        seconds = statistics.median(r["seconds"] for r in measured)
        beams = measured[0]["beams"]
        tokens = sum(len(beam) for prompt in beams for beam in prompt)
        same = sum(theirs[0] == mine[0] for theirs, mine in zip(beams, ours))
        result["engines"][name] = {"seconds": seconds, "rounds": [r["seconds"] for r in measured],
                                   "beam_tokens_per_s": tokens / seconds, "best_beam_as_nanovllm": same}
        rows.append([name, f"{seconds:.2f}", f"{tokens / seconds:.1f}", f"{same} of {len(ours)}"])
    if vllm_python:
        theirs = result["engines"][rows[-1][0]]["seconds"]
        result["speedup"] = theirs / result["engines"]["nanovllm"]["seconds"]
        print(f"nanovllm / {rows[-1][0]}, beam search: {result['speedup']:.2f}x")
    print(f"\n{len(prompts)} chat prompts, beam width {width}, {max_tokens} tokens, {weights}, {dtype}, "
          f"{args.repeat} round(s), engines in turn (median)")
    print(markdown_table(["engine", "seconds per call", "beam tokens/s", "best beam = nanovllm's"], rows))
    return result


def run_vllm(python: str, model: str, prompts: list[list[int]], width: int, max_tokens: int, dtype: str) -> dict:
    """One round of vLLM's beam search, in a process of its own."""
    print("vLLM beam search ...", file=sys.stderr)
    return run_vllm_runner(python, "vllm_beam_runner.py", model,
                           {"prompts": prompts, "beam_width": width, "max_tokens": max_tokens}, "--dtype", dtype)
