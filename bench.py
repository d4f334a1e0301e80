"""Throughput benchmark, nanovllm against transformers or vLLM: `python bench.py --help`.

The code lives in `benchmarks/`, so an installed nanovllm runs it too: `python -m nanovllm bench`.
"""
if __name__ == "__main__":  # not when tests import this file
    from nanovllm.program import quiet_ctrl_c, refuse_shadowed_package

    quiet_ctrl_c()  # before importing torch, which takes a while, so Ctrl-C may well come during it
    refuse_shadowed_package()

from benchmarks.options import parse_args  # noqa: E402 (after the checks above)
from benchmarks.throughput import main, make_requests  # noqa: E402

__all__ = ["main", "make_requests", "parse_args"]

if __name__ == "__main__":
    main()
