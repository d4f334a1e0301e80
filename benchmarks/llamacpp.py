"""The `--baseline llamacpp` mode: llama.cpp's own benchmarks on the same GGUF file and thread count, beside nanovllm's
prompt and decode rates at batch 1, 8 and 32.

llama.cpp: `llama-bench` (pp128 and tg128: batch 1) and `llama-batched-bench` (128 prompt and 128 generated tokens for
each of 8 and 32 parallel sequences). nanovllm: B requests of 128 fresh random prompt tokens (the prefix cache never
hits) and 128 greedy output tokens each (`ignore_eos`), all submitted at once; prompt tok/s is B x 128 over the time
to the last request's first token, decode tok/s the other B x 127 tokens over the rest. Rounds alternate the two
engines (`--repeat`), and each rate's median is shown. nanovllm runs through the public API only (`LLM`, its
`config`, `SamplingParams`, `add_request`/`step`).

With `--context-depths N1,N2,...`, long contexts at batch 1 too: llama-bench's `-p N` (a prompt of N tokens) and
`-n 64 -d N` (64 tokens decoded after N in the cache), and nanovllm's one request of N fresh random tokens and 65
greedy ones (prompt: N over the time to its first token; decode: the other 64 over the rest), each decode also as a
share of the batch-1 decode rate (the cache all but empty). `--kv-cache-dtype fp8` runs nanovllm's rounds over an
8-bit cache (issue 38 asks 60% of that rate after 4,096 tokens); llama.cpp keeps its 16-bit cache.

Batch-1 decode reads every weight once per token, so its limit is the machine's memory read bandwidth: the report
measures it (`benchmarks.machine.read_bandwidth`, same threads, a probe before and after each engine's round) and
gives each engine's batch-1 decode as a share of it: the bytes a token reads (the file's tensors, the token embedding
only where it is also the LM head, plus the K/V of the average context, 2-byte as llama.cpp's default cache,
nanovllm's at its cache's size) times tokens/s. Twice: over the best probe of the run (what earlier reports gave),
and paired, each round's rate over the mean of the probes just before and after that engine's round (the median of
the rounds): a shared host's bandwidth moves with its other tenants, between ~47 and ~96 GB/s on the 2-core machines,
and the paired share is what the engine made of what it was given.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch

from benchmarks.machine import read_bandwidth
from benchmarks.report import markdown_table

SETUP = "../shared/peers/setup-llamacpp.sh"
TOOLS = ("llama-bench", "llama-batched-bench")
BATCHES = (1, 8, 32)
PROMPT_TOKENS = OUTPUT_TOKENS = 128
DEPTH_TOKENS = 64  # decoded after each --context-depths prompt

Rates = dict[tuple[str, int], float]  # ("prompt" | "decode", batch size) -> tokens/s


def find_llamacpp(directory: str | None) -> Path:
    """The directory holding llama.cpp's benchmark tools; a clear exit naming the setup script when it does not."""
    missing = [tool for tool in TOOLS if not (directory and os.access(Path(directory) / tool, os.X_OK))]
    if missing:
        where = f"--llamacpp-bin {directory!r} has no {', '.join(missing)}" if directory else \
            "--baseline llamacpp needs --llamacpp-bin DIR (or $LLAMACPP_BIN)"
        sys.exit(f"bench.py: error: {where}. Build llama.cpp's tools with `bash {SETUP}` (about 5 minutes, once; it "
                 "prints the directory to pass)")
    return Path(directory)


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{command[0]} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def llamacpp_rates(bin_dir: Path, model: str, threads: int) -> Rates:
    """One round of llama-bench (batch 1) and llama-batched-bench (the larger batches) on `model`."""
    rates: Rates = {}
    single = json.loads(_run([str(bin_dir / "llama-bench"), "-m", model, "-t", str(threads), "-p", str(PROMPT_TOKENS),
                              "-n", str(OUTPUT_TOKENS), "-r", "1", "-o", "json"]))
    for test in single:
        rates["decode" if test["n_gen"] else "prompt", 1] = test["avg_ts"]
    batches = [b for b in BATCHES if b > 1]
    context = max(batches) * (PROMPT_TOKENS + OUTPUT_TOKENS)
    lines = _run([str(bin_dir / "llama-batched-bench"), "-m", model, "-t", str(threads), "-c", str(context),
                  "-npp", str(PROMPT_TOKENS), "-ntg", str(OUTPUT_TOKENS), "-npl", ",".join(map(str, batches)),
                  "--output-format", "jsonl"])
    for line in lines.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            rates["prompt", result["pl"]] = result["speed_pp"]
            rates["decode", result["pl"]] = result["speed_tg"]
    return rates


def llamacpp_depth_rates(bin_dir: Path, model: str, threads: int, depths: list[int]) -> Rates:
    """One round of llama-bench's prompts of each depth's length, and its decodes after that many tokens."""
    rates: Rates = {}
    common = [str(bin_dir / "llama-bench"), "-m", model, "-t", str(threads), "-r", "1", "-o", "json"]
    for test in json.loads(_run(common + ["-p", ",".join(map(str, depths)), "-n", "0"])):
        rates["prompt", test["n_prompt"]] = test["avg_ts"]
    for test in json.loads(_run(common + ["-p", "0", "-n", str(DEPTH_TOKENS), "-d", ",".join(map(str, depths))])):
        rates["decode", test["n_depth"]] = test["avg_ts"]
    return rates


def nanovllm_depth_rates(llm, vocab_size: int, rng: random.Random, depths: list[int]) -> Rates:
    """One round of nanovllm's batch-1 request at each depth (see the module's docstring)."""
    from nanovllm import SamplingParams

    rates: Rates = {}
    for depth in depths:
        llm.add_request([rng.randrange(vocab_size) for _ in range(depth)],
                        SamplingParams(temperature=0, max_tokens=DEPTH_TOKENS + 1, ignore_eos=True))
        start = time.perf_counter()
        while not llm.step():  # the prompt, in as many chunks as the token budget takes
            pass
        first = time.perf_counter()
        while not llm.is_finished():
            llm.step()
        rates["prompt", depth] = depth / (first - start)
        rates["decode", depth] = DEPTH_TOKENS / (time.perf_counter() - first)
    return rates


def nanovllm_rates(llm, vocab_size: int, rng: random.Random) -> Rates:
    """One round of nanovllm at each batch size (see the module's docstring)."""
    from nanovllm import SamplingParams

    rates: Rates = {}
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for batch in BATCHES:
        for _ in range(batch):
            llm.add_request([rng.randrange(vocab_size) for _ in range(PROMPT_TOKENS)], params)
        start, first, started = time.perf_counter(), None, set()
        while not llm.is_finished():
            for output in llm.step():
                started.add(output.request_id)
            if first is None and len(started) == batch:
                first = time.perf_counter()
        end = time.perf_counter()
        rates["prompt", batch] = batch * PROMPT_TOKENS / (first - start)
        rates["decode", batch] = batch * (OUTPUT_TOKENS - 1) / (end - first)
    return rates


def run(args: argparse.Namespace) -> dict:
    """Run both engines `args.repeat` times, alternating, and print the table of median rates and their ratio."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.kernels.attention.kv_quant import cache_row_width
    from nanovllm.models.hf_config import head_dim

    bin_dir = find_llamacpp(args.llamacpp_bin)
    threads = args.threads or torch.get_num_threads()
    rng = random.Random(args.seed)
    ours: list[Rates] = []
    theirs: list[Rates] = []
    with LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=max(BATCHES), kv_cache_dtype=args.kv_cache_dtype,
             max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS) as llm:
        vocab_size = llm.config.hf_config.vocab_size
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        probes: list[float] = []  # before llama.cpp's round, between the two, after nanovllm's; each round
        beside: dict[str, list[float]] = {"llamacpp": [], "nanovllm": []}
        for _ in range(args.repeat):
            probes.append(read_bandwidth())  # each round: the host's other tenants come and go
            print("llama.cpp ...", file=sys.stderr)
            theirs.append(llamacpp_rates(bin_dir, args.model, threads))
            probes.append(read_bandwidth())
            print("nanovllm ...", file=sys.stderr)
            ours.append(nanovllm_rates(llm, vocab_size, rng))
            probes.append(read_bandwidth())
            beside["llamacpp"].append((probes[-3] + probes[-2]) / 2)
            beside["nanovllm"].append((probes[-2] + probes[-1]) / 2)
        bandwidth = max(probes)
        dtype = str(llm.config.torch_dtype).removeprefix("torch.")
        weights, kv = token_bytes(args.model, llm.config.hf_config, PROMPT_TOKENS + OUTPUT_TOKENS // 2)
        values, cache = head_dim(llm.config.hf_config), llm.config.kv_cache_torch_dtype  # an int8 cache's scales too
        ours_kv = cache.itemsize * cache_row_width(values, cache) / values
        kv_itemsize = {"nanovllm": ours_kv, "llamacpp": 2}
    rows = []
    for kind, batch in [(kind, batch) for kind in ("prompt", "decode") for batch in BATCHES]:
        us, them = median(r[kind, batch] for r in ours), median(r[kind, batch] for r in theirs)
        rows.append({"rate": kind, "batch": batch, "nanovllm": us, "llamacpp": them, "ratio": us / them})
    print(f"\n{Path(args.model).name}, {threads} threads, {PROMPT_TOKENS} prompt and {OUTPUT_TOKENS} output tokens per "
          f"sequence, nanovllm activations in {dtype}, median of {args.repeat} round(s)")
    print(markdown_table(["tok/s", "batch", "nanovllm", "llama.cpp", "nanovllm / llama.cpp"],
                         [[r["rate"], str(r["batch"]), f"{r['nanovllm']:.1f}", f"{r['llamacpp']:.1f}",
                           f"{r['ratio']:.2f}x"] for r in rows]))
    shares, paired = {}, {}
    for engine, itemsize in kv_itemsize.items():
        rate = next(r[engine] for r in rows if (r["rate"], r["batch"]) == ("decode", 1))
        shares[engine] = (weights + kv * itemsize) * rate / bandwidth
        rounds = ours if engine == "nanovllm" else theirs
        paired[engine] = median((weights + kv * itemsize) * r["decode", 1] / probe
                                for r, probe in zip(rounds, beside[engine]))
    print(f"batch-1 decode reads {weights / 1e6:.1f} MB of weights per token and {kv * 2 / 1e6:.1f} MB of K/V at 2 "
          f"bytes ({PROMPT_TOKENS + OUTPUT_TOKENS // 2} tokens of context; nanovllm's cache {ours_kv:.3g} byte(s) a "
          f"value); the machine reads {bandwidth / 1e9:.1f} GB/s ({threads} threads, a 1 GiB sum, the best of the "
          f"run's probes): nanovllm decodes at {shares['nanovllm']:.0%} of it, llama.cpp at {shares['llamacpp']:.0%}; "
          f"paired with the probes beside each round ({min(probes) / 1e9:.1f} to {max(probes) / 1e9:.1f} GB/s): "
          f"nanovllm {paired['nanovllm']:.0%}, llama.cpp {paired['llamacpp']:.0%}")
    result = {"llamacpp": rows, "threads": threads, "read_bandwidth": bandwidth, "weight_bytes_per_token": weights,
              "bandwidth_share_batch1": shares, "bandwidth_share_batch1_paired": paired, "bandwidth_probes": probes,
              "rounds": {"nanovllm": [_plain(r) for r in ours], "llamacpp": [_plain(r) for r in theirs]}}
    if args.context_depths:
        result["context_depths"] = run_depths(args, bin_dir, threads, rng)
        batch1 = {engine: next(r[engine] for r in rows if (r["rate"], r["batch"]) == ("decode", 1))
                  for engine in kv_itemsize}
        decodes = [r for r in result["context_depths"] if r["rate"] == "decode"]
        shares = [f"{r['tokens']}: nanovllm {r['nanovllm'] / batch1['nanovllm']:.0%}, llama.cpp "
                  f"{r['llamacpp'] / batch1['llamacpp']:.0%}" for r in decodes]
        print(f"decode after N tokens as a share of batch-1 decode above ({PROMPT_TOKENS + OUTPUT_TOKENS // 2} tokens "
              f"of context), K/V of nanovllm in {args.kv_cache_dtype}, llama.cpp's 16-bit: " + "; ".join(shares))
    return result


def run_depths(args: argparse.Namespace, bin_dir: Path, threads: int, rng: random.Random) -> list[dict]:
    """The long-context rounds (`--context-depths`), alternating as the others, and their table."""
    from nanovllm import LLM

    depths = args.context_depths
    ours: list[Rates] = []
    theirs: list[Rates] = []
    with LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=1, enable_prefix_caching=False,
             kv_cache_dtype=args.kv_cache_dtype, max_model_len=max(depths) + DEPTH_TOKENS + 1) as llm:
        vocab_size = llm.config.hf_config.vocab_size
        for _ in range(args.repeat):
            theirs.append(llamacpp_depth_rates(bin_dir, args.model, threads, depths))
            ours.append(nanovllm_depth_rates(llm, vocab_size, rng, depths))
    rows = []
    for kind, depth in [(kind, depth) for kind in ("prompt", "decode") for depth in depths]:
        us, them = median(r[kind, depth] for r in ours), median(r[kind, depth] for r in theirs)
        rows.append({"rate": kind, "tokens": depth, "nanovllm": us, "llamacpp": them, "ratio": us / them})
    print(f"\nbatch 1 at long contexts: a prompt of N tokens, then {DEPTH_TOKENS} tokens decoded after N in the cache")
    print(markdown_table(["tok/s", "N", "nanovllm", "llama.cpp", "nanovllm / llama.cpp"],
                         [[r["rate"], str(r["tokens"]), f"{r['nanovllm']:.1f}", f"{r['llamacpp']:.1f}",
                           f"{r['ratio']:.2f}x"] for r in rows]))
    return rows


def token_bytes(model: str, hf_config, context: int) -> tuple[int, int]:
    """What a batch-1 decode step reads: the GGUF file's weights (the token embedding only where the LM head is tied to
    it: else one row), and the number of K and V elements over `context` tokens (times the cache's item size)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(model).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return sum(tensors.values()), 2 * hf_config.num_hidden_layers * heads * head_dim * context


def _plain(rates: Rates) -> dict[str, float]:
    return {f"{kind} {batch}": value for (kind, batch), value in sorted(rates.items())}
