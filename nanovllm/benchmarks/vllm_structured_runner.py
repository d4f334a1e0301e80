"""Run vLLM's offline `LLM.generate` on structured-output requests and print one JSON line of figures.

Run by `bench.py --structured --baseline vllm` with vLLM's own interpreter, so it imports only the standard library
and vLLM:

    VLLM_PYTHON vllm_structured_runner.py MODEL_DIR REQUESTS.json --dtype bfloat16

REQUESTS.json: `{"prompts": [[token ids], ...], "constraints": [{"json": schema} | {"regex": ...} | ..., ...],
"max_tokens": n, "repeat": r, "fresh_schemas": [schema, ...], "checks": {"prompts": [...], "constraints": [...]}}`.
Greedy, as nanovllm's side of the benchmark: constrained, then the same prompts unconstrained with `ignore_eos` and
each request's constrained length, `repeat` times interleaved; then the time of a one-token request with a schema
never seen before against one without; then the outputs of the `checks` requests (greedy, and sampled with a seed).
"""
import argparse
import json
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("requests")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", default="4")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    with open(args.requests) as f:
        spec = json.load(f)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]

    def constrained(constraint, **kw):
        return SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), **kw)

    def timed(prompts, params):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    timed(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
    runs = {"constrained": [], "unconstrained": []}
    texts = []
    for _ in range(spec["repeat"]):
        seconds, outputs = timed(prompts, [constrained(c, temperature=0, max_tokens=spec["max_tokens"])
                                           for c in spec["constraints"]])
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        texts = [o.outputs[0].text for o in outputs]
        runs["constrained"].append((seconds, sum(lengths)))
        seconds, outputs = timed(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                           for n in lengths])
        runs["unconstrained"].append((seconds, sum(len(o.outputs[0].token_ids) for o in outputs)))
    ttft = {"fresh_schema": [], "unconstrained": []}
    for schema in spec["fresh_schemas"]:
        ttft["fresh_schema"].append(timed(prompts[:1], constrained({"json": schema}, temperature=0, max_tokens=1))[0])
        ttft["unconstrained"].append(timed(prompts[:1], SamplingParams(temperature=0, max_tokens=1))[0])
    checks = spec["checks"]
    check_prompts = [TokensPrompt(prompt_token_ids=ids) for ids in checks["prompts"]]
    check_texts = {}
    for name, kw in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 0})):
        outputs = llm.generate(check_prompts, [constrained(c, max_tokens=spec["max_tokens"], **kw)
                                               for c in checks["constraints"]], use_tqdm=False)
        check_texts[name] = [o.outputs[0].text for o in outputs]
    print(json.dumps({"engine": f"vLLM {vllm.__version__}",
                      "tokens_per_s": {k: statistics.median(t / s for s, t in v) for k, v in runs.items()},
                      "ttft_s": {k: statistics.median(v) for k, v in ttft.items()},
                      "texts": texts, "checks": check_texts}))


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    main()
