"""Run vLLM's pooling runner (`LLM.embed`) on one round of texts and print one JSON line of figures.

Run by `bench.py --task embed --baseline vllm` with vLLM's own interpreter, so it imports only the standard library
and vLLM:

    VLLM_PYTHON vllm_embed_runner.py MODEL_DIR TEXTS.json --dtype float32

TEXTS.json: `{"texts": [...]}`. A warm-up call on eight texts, then one timed call over all of them; the embeddings
are printed for the comparison.
"""
import json
import time

from vllm_runner_args import runner_args


def main() -> None:
    args, spec = runner_args()
    import vllm
    from vllm import LLM

    texts = spec["texts"]
    llm = LLM(model=args.model, runner="pooling", dtype=args.dtype, seed=0)
    llm.embed(texts[:8], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(json.dumps({"engine": f"vLLM {vllm.__version__}", "seconds": seconds,
                      "embeddings": [list(out.outputs.embedding) for out in outputs]}))


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    main()
