"""The `--task embed` mode: `LLM.embed` against sentence-transformers' `encode` (and vLLM's pooling runner) on the
same texts, same model, same threads.

`--num-seqs` texts (default 512) of 20 to 120 words, drawn (seeded) from a list of common words, embedded by: nanovllm
(`LLM(model, runner="pooling").embed`, all texts in one call), sentence-transformers (`SentenceTransformer(model)
.encode(texts, batch_size=32)`, its default batch, in the engine's dtype) and, with `--baseline vllm`, vLLM's
`LLM(model, runner="pooling").embed` in its own python (`vllm_embed_runner.py`). Each round times every engine in
turn (`--repeat` rounds, medians); after a warm-up call each. The report gives texts/s, prompt tokens/s (nanovllm's
token counts), each engine's ratio to sentence-transformers, and the lowest cosine between nanovllm's vector of a text
and the other engine's.

`--model` is a sentence-transformers directory (its pooling, Dense and Normalize modules are read by both) or a model
directory nanovllm embeds with the architecture's defaults.
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.baselines import find_vllm_python, run_vllm_runner
from benchmarks.machine import bench_device
from benchmarks.report import markdown_table
from nanovllm import LLM

WORDS = ("the model reads every word of a text and returns one vector for it so that texts with the same meaning lie "
         "close together search engines rank documents by the cosine of their vectors against a query and a cache of "
         "keys and values makes long prompts cheap on a small machine with two cores and little memory").split()


def texts(count: int, seed: int) -> list[str]:
    """`count` texts of 20 to 120 words each, seeded."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))).capitalize() + "." for _ in range(count)]


def run(args: argparse.Namespace) -> dict:
    """--task embed: the table of every engine's figures, printed; the figures returned."""
    from sentence_transformers import SentenceTransformer

    device = bench_device(args.device)
    corpus = texts(args.num_seqs or 512, args.seed)
    vllm_python = find_vllm_python(args.vllm_python, device) if args.baseline == "vllm" else None
    with LLM(args.model, runner="pooling", device=device, dtype=args.dtype) as llm:
        dtype = llm.config.torch_dtype
        reference = SentenceTransformer(args.model, device=device, model_kwargs={"dtype": dtype})
        engines = {"nanovllm": lambda: [o.outputs.embedding for o in llm.embed(corpus, use_tqdm=False)],
                   "sentence-transformers": lambda: reference.encode(corpus, batch_size=32).tolist()}
        sample = corpus[:64]  # the corpus's token count, estimated from its first texts (all of them when few)
        tokens = sum(len(o.prompt_token_ids) for o in llm.embed(sample, use_tqdm=False)) * len(corpus) / len(sample)
        for embed in engines.values():  # warm-up
            embed()
        rounds: dict[str, list[float]] = {}
        vectors: dict[str, list[list[float]]] = {}
        for _ in range(args.repeat):
            for name, embed in engines.items():
                start = time.perf_counter()
                vectors[name] = embed()
                rounds.setdefault(name, []).append(time.perf_counter() - start)
            if vllm_python:
                figures = run_vllm(vllm_python, args.model, corpus, str(dtype).removeprefix("torch."))
                rounds.setdefault(figures["engine"], []).append(figures["seconds"])
                vectors[figures["engine"]] = figures["embeddings"]
    ours = torch.tensor(vectors["nanovllm"])
    base = statistics.median(rounds["sentence-transformers"])
    result = {"model": args.model, "dtype": str(dtype), "texts": len(corpus), "engines": {}}
    rows = []
    for name, seconds in rounds.items():
        median = statistics.median(seconds)
        cosine = torch.nn.functional.cosine_similarity(ours, torch.tensor(vectors[name]), dim=-1).min().item()
        result["engines"][name] = {"seconds": median, "rounds": seconds, "texts_per_s": len(corpus) / median,
                                   "ratio": base / median, "min_cosine_to_nanovllm": cosine}
        rows.append([name, f"{len(corpus) / median:.1f}", f"{tokens / median:.0f}", f"{base / median:.2f}x",
                     f"{cosine:.6f}"])
    print(f"\n{len(corpus)} texts of 20-120 words, {Path(args.model).name}, {str(dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads, {args.repeat} round(s), engines in turn (median)")
    print(markdown_table(["engine", "texts/s", "tokens/s", "vs sentence-transformers", "lowest cosine to nanovllm"],
                         rows))
    return result


def run_vllm(python: str, model: str, corpus: list[str], dtype: str) -> dict:
    """One round of vLLM's pooling runner, in a process of its own."""
    print("vLLM embed ...", file=sys.stderr)
    return run_vllm_runner(python, "vllm_embed_runner.py", model, {"texts": corpus}, "--dtype", dtype)
