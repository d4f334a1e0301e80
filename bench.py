"""The benchmarks' one front: `python bench.py --help`.

It parses the flags (`benchmarks.options`) and runs the mode they name, a module of `benchmarks/` with
`run(args) -> dict` (see `MODES`): it prints its report and returns its results, which `--json` writes. No mode
imports another; what they share (flags, workloads, the model under test, machine probes, report formatting) lives in
the shared modules beside them. Two kernel benchmarks run on their own: `python -m benchmarks.step_profile` and
`python -m benchmarks.ggml_kernels`.
"""
if __name__ == "__main__":  # not when tests import this file
    from nanovllm.program import quiet_ctrl_c, refuse_shadowed_package

    quiet_ctrl_c()  # before importing torch, which takes a while, so Ctrl-C may well come during it
    refuse_shadowed_package()

import argparse  # noqa: E402 (after the checks above)
from importlib import import_module  # noqa: E402

from benchmarks.options import parse_args  # noqa: E402
from benchmarks.report import save_json  # noqa: E402
from benchmarks.workload import make_requests  # noqa: E402

__all__ = ["MODES", "STANDALONE", "main", "make_requests", "mode", "parse_args"]

MODES = {  # mode -> its module; `mode` says which flags name which
    "throughput": "benchmarks.throughput",  # the workload, against --baseline none, hf or vllm
    "llamacpp": "benchmarks.llamacpp",  # --baseline llamacpp
    "attention-micro": "benchmarks.attention",  # --attention-micro
    "host-overhead": "benchmarks.host",  # --host-overhead
    "structured": "benchmarks.structured",  # --structured
    "jump-forward": "benchmarks.structured_jump",  # --structured --jump-forward-compare
    "beam-search": "benchmarks.beam",  # --beam-search
    "weights-update": "benchmarks.weights_update",  # --weights-update
    "embed": "benchmarks.embed",  # --task embed
    "lora": "benchmarks.lora",  # --lora N
}
STANDALONE = ("benchmarks.step_profile", "benchmarks.ggml_kernels")  # `python -m ...`, flags of their own


def mode(args: argparse.Namespace) -> str:
    """The mode the flags name; the first that applies, in this order."""
    if args.baseline == "llamacpp":
        return "llamacpp"
    if args.attention_micro:
        return "attention-micro"
    if args.host_overhead:
        return "host-overhead"
    if args.structured:
        return "jump-forward" if args.jump_forward_compare else "structured"
    if args.beam_search:
        return "beam-search"
    if args.weights_update:
        return "weights-update"
    if args.task == "embed":
        return "embed"
    if args.lora:
        return "lora"
    return "throughput"


def main(argv: list[str] | None = None) -> dict:
    """Run the mode `argv` names (default: the command line); print its report and return its results."""
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return save_json(import_module(MODES[mode(args)]).run(args), args.json)


if __name__ == "__main__":
    main()
