"""CPU kernels compiled with `torch.utils.cpp_extension` (g++ and torch's headers) the first time an engine starts on
the CPU, into nanovllm's cache directory, per torch version, CPU (`-march=native` code runs only where it was built)
and source: `paged_decode`, every single-query row of a step in one call, an encoder's attention over a step's ragged
batch in one call per layer (`csrc/encoder_attention.cpp`, reached through `models.bert`), the decoder's small ops
fused (`csrc/fused_ops.cpp`: RMSNorm with the residual add, rotary, SiLU-and-mul, the KV-cache store; the layers reach
them through `kernels.fused.fused_op`), matmuls over GGML-quantized weights (`csrc/ggml_quant.cpp`, reached through
`kernels.ggml`), the whole decode step of a standard decoder in one call (`csrc/decoder_stack.cpp`, reached
through `execution.cpu_decode`), and LoRA deltas, each row its own adapter's (`csrc/lora_ops.cpp`, reached through
`layers.lora`).

They are torch operators (`torch.ops.nanovllm.*`, registered by `csrc/module.cpp`) in a plain shared library, not a
Python extension module: the sources include only ATen's headers, not `<torch/extension.h>` with pybind11 and the C++
frontend, which made up most of a build that took minutes. ninja compiles the files in parallel; `load` returns only
at the end, so a thread says how far the build has got every `PROGRESS_EVERY_S` meanwhile.

Builds are serialized by an OS lock that dies with its holder: torch's own lock is a file that a build killed
midway leaves behind, after which every later `load` waits for it forever. Without a working compiler, or when
another process keeps building past `BUILD_WAIT_S`, the engine falls back to torch's operators and says so once
(logger "nanovllm").
"""
import contextlib
import functools
import logging
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch
import xxhash

from nanovllm.cache import cache_dir, exclusive
from nanovllm.progress import Progress

logger = logging.getLogger("nanovllm")
NAME = "nanovllm_cpu_kernels"
CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "module.cpp", CSRC / "paged_decode.cpp", CSRC / "encoder_attention.cpp", CSRC / "fused_ops.cpp",
           CSRC / "ggml_quant.cpp", CSRC / "decoder_stack.cpp", CSRC / "lora_ops.cpp", CSRC / "sampling.cpp"]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
BUILD_WAIT_S = 600.0
DECODE_CHUNK = 256  # keys per work item of `paged_decode` (`CHUNK` in csrc/paged_decode.cpp): what sizes its memory
PROGRESS_EVERY_S = 10.0


def build_directory() -> Path:
    """Where this torch, Python, CPU, compiler flags and source (headers included, which torch's rebuild check
    ignores) keep the built kernels. The sources' folder is part of the key too: the build files name the sources
    by path, so two clones sharing one cache would otherwise rebuild over each other."""
    cpu = next((line for line in _cpuinfo().splitlines() if line.startswith("flags")), platform.processor())
    source = b"".join(path.read_bytes() for path in sorted(CSRC.iterdir()))
    build = f"{torch.__version__}|{sys.version}|{platform.machine()}|{cpu}|{CFLAGS}|{CSRC.resolve()}|"
    key = xxhash.xxh64_hexdigest(build.encode() + source)
    return cache_dir() / "kernels" / key


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernels, `torch.ops.nanovllm` (`.paged_decode(...)`, `.rms_norm(...)`, ...), or None (logged once)
    when they cannot be built here."""
    from torch.utils.cpp_extension import load

    directory = build_directory()
    try:
        with exclusive(directory / "build.lock", BUILD_WAIT_S):
            (directory / "lock").unlink(missing_ok=True)  # torch's lock file, left by a build that was killed
            built = (directory / f"{NAME}.so").exists()
            with contextlib.nullcontext() if built else build_progress(directory):
                load(NAME, [str(path) for path in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                     build_directory=str(directory), verbose=False, is_python_module=False)  # and torch.ops loads it
            return torch.ops.nanovllm
    except Exception as e:  # no compiler, no headers, a failed build, a build elsewhere that never ends
        hint = "" if shutil.which("c++") or shutil.which("g++") else " Install g++ to get them."
        logger.warning("nanovllm: CPU kernels could not be built in %s (%s); attention and the small ops run on "
                       "torch's operators (slower).%s", directory, str(e).splitlines()[0][:200], hint)
        return None


def build_progress(directory: Path) -> Progress:
    """What is built where, then a line every `PROGRESS_EVERY_S` (ninja compiles the files side by side, so they
    finish together: elapsed time is all there is to say), and how long it took."""
    progress = Progress("built the CPU kernels", every=PROGRESS_EVERY_S)
    progress("building the CPU kernels", detail=f" into {directory}, {len(SOURCES)} C++ files in parallel (once per "
             "torch version, CPU and source; about 40 s on 2 cores)")
    return progress


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0,
                 softcap: float = 0.0) -> torch.Tensor | None:
    """Attention of single-query rows q `[rows, heads, head_dim]` over their cached K/V (caches `[blocks, block_size,
    kv_heads, head_dim]`, row i's blocks in `block_tables[i]`, its first `context_lens[i]` tokens, only the last
    `window` of them where `window` > 0; scores capped by `softcap` > 0); None without the compiled kernels."""
    kernels = cpu_kernels()
    if kernels is None:
        return None
    return kernels.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap)
