"""The command line every `vllm_*_runner.py` script takes, and the request file it reads. The runners run in vLLM's own
python (vLLM pins its own torch and transformers), so this imports only the standard library; they import it as a
sibling script (`python benchmarks/vllm_x_runner.py` puts benchmarks/ first on sys.path)."""
import argparse
import json
import os


def runner_args() -> tuple[argparse.Namespace, dict]:
    """`MODEL_DIR SPEC.json [--dtype D] [--max-model-len N] [--kv-cache-gib G]`, parsed, with vLLM's CPU KV cache sized
    by `--kv-cache-gib` (before vLLM is imported); and the JSON spec the benchmark wrote."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("spec")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", default="4")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)
    with open(args.spec) as f:
        return args, json.load(f)
