"""Run vLLM's offline `LLM.generate` with LoRA adapters on one round of requests and print one JSON line of figures.

Run by `bench.py --lora N --baseline vllm` with vLLM's own interpreter, so it imports only the standard library and
vLLM:

    VLLM_PYTHON vllm_lora_runner.py MODEL_DIR REQUESTS.json --dtype float32 --max-model-len N

REQUESTS.json: `{"prompts": [[token ids], ...], "max_tokens": [n, ...], "adapters": [PEFT directory, ...], "rank": r}`.
Greedy with `ignore_eos`; request i runs under adapter i mod N. A warm-up call loads every adapter; then the requests
are timed without an adapter and with theirs (output tokens per second each).
"""
import json
import time

from vllm_runner_args import runner_args


def main() -> None:
    args, spec = runner_args()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = spec["adapters"]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=spec["rank"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["max_tokens"]]
    loras = [LoRARequest(f"adapter-{i % len(adapters)}", i % len(adapters) + 1, adapters[i % len(adapters)])
             for i in range(len(prompts))]
    warm = SamplingParams(temperature=0, max_tokens=4)
    llm.generate(prompts[:len(adapters)], warm, lora_request=loras[:len(adapters)], use_tqdm=False)
    rates = {}
    for name, lora in (("base", None), ("adapters", loras)):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        rates[name] = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
    print(json.dumps({"engine": f"vLLM {vllm.__version__}", **rates}))


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    main()
