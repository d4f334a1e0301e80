"""The model under test: `--model` (a model directory or a GGUF file) or `--config` with random weights, and what the
baselines load beside it (`model_under_test` for the throughput workload, `structured_weights` for `--structured`).

Not the engine: finding a GGUF file's cached config (`nanovllm.models.gguf.metadata.find_gguf`, `cached_metadata`) and
converting the file for a baseline (`nanovllm.models.gguf.convert.convert_gguf`, what `python -m nanovllm convert`
runs) are public functions of the models room, used because the `LLM` API has no call for them.
"""
import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.workload import count_parameters, write_random_checkpoint
from nanovllm.models.gguf.convert import convert_gguf
from nanovllm.models.gguf.metadata import cached_metadata, find_gguf


def config_dir(model: str) -> str:
    """The directory holding the model's config.json: the model directory, or a GGUF file's metadata."""
    gguf = find_gguf(model)
    return str(cached_metadata(gguf)) if gguf else model


def weights_bytes(model: str, dtype: torch.dtype) -> int:
    """What the weights take in memory: a GGUF file's size (its weights stay as stored), else parameters x dtype."""
    gguf = find_gguf(model)
    return os.path.getsize(gguf) if gguf else count_parameters(model) * dtype.itemsize


@contextmanager
def model_under_test(args: argparse.Namespace) -> Iterator[tuple[str, str, str, str]]:
    """(model, the baseline's model directory, load format, name): `--model`, or `--config` in a temporary directory
    with dummy weights (random real ones when transformers is the baseline, so both engines run the same weights).
    A GGUF file runs as it is in nanovllm; transformers and vLLM get it converted to a float32 directory."""
    if args.model:
        name, gguf = Path(os.path.normpath(args.model)).name.removesuffix(".gguf"), find_gguf(args.model)
        if not gguf or args.baseline not in ("hf", "vllm"):
            yield args.model, args.model, "auto", name
            return
        with tempfile.TemporaryDirectory(prefix="nanovllm-bench-") as tmp:
            print(f"converting {gguf} to float32 for the {args.baseline} baseline ...", file=sys.stderr)
            convert_gguf(gguf, tmp)
            yield args.model, tmp, "auto", name
        return
    with tempfile.TemporaryDirectory(prefix="nanovllm-bench-") as tmp:
        shutil.copy(args.config, os.path.join(tmp, "config.json"))
        load_format = "dummy"
        if args.baseline == "hf":
            print("writing a random checkpoint for both engines ...", file=sys.stderr)
            write_random_checkpoint(args.config, tmp, args.seed)
            load_format = "auto"
        yield tmp, tmp, load_format, Path(args.config).stem + " (random)"


@contextmanager
def structured_weights(model: str, baseline: str) -> Iterator[tuple[str, str, str | None]]:
    """(the model both engines load, what it is, a GGUF file nanovllm also runs as it is): with vLLM as the baseline
    a GGUF file is dequantized to a float32 directory for both, so they run the same weights in the same dtype, and
    nanovllm runs the file as it is too (what its users run; vLLM's CPU build has no GGUF kernels); otherwise the
    model as given."""
    gguf = find_gguf(model)
    if baseline != "vllm" or not gguf:
        yield model, Path(os.path.normpath(model)).name, None
        return
    with tempfile.TemporaryDirectory(prefix="nanovllm-bench-") as tmp:
        print(f"converting {gguf} to float32, the weights both engines load ...", file=sys.stderr)
        convert_gguf(gguf, tmp)
        yield tmp, f"{Path(gguf).name} dequantized (both engines)", gguf
