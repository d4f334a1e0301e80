"""CPU kernels compiled at first use with `torch.utils.cpp_extension` (g++ and torch's headers; cached by torch per
machine, so later starts load the built library): `paged_decode`, every single-query row of a step in one call.

Without a working compiler the engine falls back to torch's own operators and says so once (logger "nanovllm").
"""
import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger("nanovllm")
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"


@functools.cache
def cpu_kernels():
    """The compiled extension module, or None (logged once) when it cannot be built here."""
    from torch.utils.cpp_extension import load

    try:
        return load("nanovllm_cpu_kernels", [str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build: the torch path still works
        logger.warning("nanovllm: CPU kernels could not be built (%s); decode attention runs on torch's operators, "
                       "one call per sequence (slower). Install g++ to get them.", str(e).splitlines()[0][:200])
        return None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Attention of single-query rows q `[rows, heads, head_dim]` over their cached K/V (caches `[blocks, block_size,
    kv_heads, head_dim]`, row i's blocks in `block_tables[i]`, its first `context_lens[i]` tokens); None without the
    compiled kernels."""
    kernels = cpu_kernels()
    return None if kernels is None else kernels.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
