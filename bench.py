"""Throughput benchmark, nanovllm against transformers or vLLM: `python bench.py --help`.

The code lives in `nanovllm/benchmarks/`, so an installed nanovllm runs it too: `python -m nanovllm bench`.
"""
from nanovllm.benchmarks.options import parse_args
from nanovllm.benchmarks.throughput import main, make_requests

__all__ = ["main", "make_requests", "parse_args"]

if __name__ == "__main__":
    main()
