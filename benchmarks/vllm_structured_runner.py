"""Run vLLM's offline `LLM.generate` on one round of structured-output requests and print one JSON line of figures.

Run by `bench.py --structured --baseline vllm` with vLLM's own interpreter, so it imports only the standard library
and vLLM:

    VLLM_PYTHON vllm_structured_runner.py MODEL_DIR REQUESTS.json --dtype bfloat16

REQUESTS.json: `{"prompts": {"constrained": [[token ids], ...], "unconstrained": [...]}, "warmup": [[token ids], ...],
"constraints": [{"json": schema} | {"regex": ...} | ..., ...], "max_tokens": n, "ttft": {"prompts": [...],
"schemas": [schema, ...]}, "checks": {"prompts": [...], "constraints": [...]}}`. Greedy, as nanovllm's side of the
benchmark: a warm-up batch, then the constrained prompts, then the unconstrained prompts with `ignore_eos`
and each request's constrained length; then one-token requests alone, alternately with a schema never seen before
and without one, each on a prompt of its own (`ttft.prompts`, two per schema); then the outputs of the `checks`
requests (greedy, and sampled with a seed), if any.
"""
import json
import os
import statistics
import time

from vllm_runner_args import runner_args


def main() -> None:
    args, spec = runner_args()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)

    def tokens(ids):
        return [TokensPrompt(prompt_token_ids=p) for p in ids]

    def constrained(constraint, **kw):
        return SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), **kw)

    def timed(prompts, params):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    load = [os.getloadavg()[0]]
    prompts = spec["prompts"]
    checks = spec["checks"]
    timed(tokens(spec["warmup"]), SamplingParams(temperature=0, max_tokens=4))
    seconds, outputs = timed(tokens(prompts["constrained"]), [constrained(c, temperature=0,
                                                                          max_tokens=spec["max_tokens"])
                                                              for c in spec["constraints"]])
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    tokens_per_s = {"constrained": sum(lengths) / seconds}
    texts = [o.outputs[0].text for o in outputs]
    seconds, outputs = timed(tokens(prompts["unconstrained"]), [SamplingParams(temperature=0, max_tokens=n,
                                                                               ignore_eos=True) for n in lengths])
    tokens_per_s["unconstrained"] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
    ttft = {"fresh_schema": [], "unconstrained": []}
    fresh = tokens(spec["ttft"]["prompts"])
    for i, schema in enumerate(spec["ttft"]["schemas"]):
        params = constrained({"json": schema}, temperature=0, max_tokens=1)
        ttft["fresh_schema"].append(timed(fresh[2 * i:2 * i + 1], params)[0])
        ttft["unconstrained"].append(timed(fresh[2 * i + 1:2 * i + 2], SamplingParams(temperature=0, max_tokens=1))[0])
    check_texts = {}
    for name, kw in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 0})):
        if checks["prompts"]:
            outputs = llm.generate(tokens(checks["prompts"]), [constrained(c, max_tokens=spec["max_tokens"], **kw)
                                                               for c in checks["constraints"]], use_tqdm=False)
            check_texts[name] = [o.outputs[0].text for o in outputs]
    load.append(os.getloadavg()[0])
    print(json.dumps({"engine": f"vLLM {vllm.__version__}", "tokens_per_s": tokens_per_s,
                      "ttft_s": {k: statistics.median(v) for k, v in ttft.items()},
                      "texts": texts, "checks": check_texts, "load": load}))


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    main()
