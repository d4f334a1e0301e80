"""Run vLLM's offline `LLM.beam_search` on one round of requests and print one JSON line of figures.

Run by `bench.py --beam-search --baseline vllm` with vLLM's own interpreter, so it imports only the standard library
and vLLM:

    VLLM_PYTHON vllm_beam_runner.py MODEL_DIR REQUESTS.json --dtype float32

REQUESTS.json: `{"prompts": [[token ids], ...], "beam_width": w, "max_tokens": n}`. A warm-up call on two prompts,
then one timed call over all of them; the beams' generated tokens are printed for the comparison.
"""
import json
import time

from vllm_runner_args import runner_args


def main() -> None:
    args, spec = runner_args()
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    params = BeamSearchParams(beam_width=spec["beam_width"], max_tokens=spec["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm.beam_search(prompts[:2], params)
    start = time.perf_counter()
    outputs = llm.beam_search(prompts, params)
    seconds = time.perf_counter() - start
    beams = [[s.tokens[len(ids):] for s in out.sequences] for out, ids in zip(outputs, spec["prompts"])]
    print(json.dumps({"engine": f"vLLM {vllm.__version__}", "seconds": seconds, "beams": beams}))


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    main()
