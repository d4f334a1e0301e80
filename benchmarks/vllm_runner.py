"""Run vLLM's offline `LLM.generate` on a request file and print one JSON line of figures.

Run by the benchmark with vLLM's own interpreter (vLLM pins its own torch and transformers), so it imports only
the standard library and vLLM:

    VLLM_PYTHON vllm_runner.py MODEL_DIR REQUESTS.json --dtype bfloat16 [--dummy] [--max-model-len N]

REQUESTS.json is `{"prompts": [[token ids], ...], "max_tokens": [n, ...]}`, with optionally `"sampling"` (the
`SamplingParams` fields every request shares; greedy without) and `"seeds"` (one per request); every request has
`ignore_eos`, so any engine given the file produces exactly `sum(max_tokens)` tokens. `--dummy`: random weights
(MODEL_DIR needs only config.json). Start-up (weights, compilation, KV cache) and one short warm-up request are not
timed.
"""
import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("requests")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dummy", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", default="4", help="vLLM's CPU KV cache (nanovllm's default budget too)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.requests) as f:
        requests = json.load(f)
    extra = {"load_format": "dummy", "skip_tokenizer_init": True} if args.dummy else {}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed, **extra)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in requests["prompts"]]
    sampling = requests.get("sampling", {"temperature": 0})
    seeds = requests.get("seeds") or [None] * len(prompts)
    params = [SamplingParams(**sampling, seed=seed, max_tokens=n, ignore_eos=True, detokenize=not args.dummy)
              for n, seed in zip(requests["max_tokens"], seeds)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, detokenize=not args.dummy), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    print(json.dumps({"engine": f"vLLM {vllm.__version__}", "tokens": tokens, "seconds": seconds,
                      "first_tokens": [out.outputs[0].token_ids[:4] for out in outputs]}))


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    main()
