"""Throughput benchmark, nanovllm against transformers: `python bench.py --help`.

The code lives in `nanovllm/benchmarks/throughput.py`, so an installed nanovllm runs it too: `python -m nanovllm bench`.
"""
from nanovllm.benchmarks.throughput import main, make_requests, parse_args

__all__ = ["main", "make_requests", "parse_args"]

if __name__ == "__main__":
    main()
