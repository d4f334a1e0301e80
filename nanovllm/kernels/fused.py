"""How the small fused ops (norms, activation, rotary, sampler) run, chosen once at start-up by the model runner.

Each op is written once in torch (`fused_op`). On CUDA without `enforce_eager` it runs through `torch.compile`; on
the CPU, an op that names a `cpu_kernel` runs as that function of the compiled CPU kernels (one pass over its rows
instead of several torch operators; `kernels/csrc/fused_ops.cpp` computes what the torch code computes); anywhere
else it runs eagerly, exactly as written, and torch's compiler is never even imported.
"""
import functools
from types import ModuleType
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_compiled = False
_cpu_kernels: ModuleType | None = None


def set_fused_ops(compiled: bool, cpu_kernels: ModuleType | None) -> None:
    """`compiled`: run the ops through torch.compile; `cpu_kernels`: the compiled CPU kernels, for CPU inputs."""
    global _compiled, _cpu_kernels
    _compiled, _cpu_kernels = compiled, cpu_kernels


def cpu_kernel(name: str) -> Callable | None:
    """The CPU kernel `name` as set by `set_fused_ops`, or None (not on the CPU, or the kernels are not built)."""
    return None if _cpu_kernels is None else getattr(_cpu_kernels, name)


def fused_op(fn: F | None = None, *, cpu_kernel: str | None = None) -> F:
    """`fn` as set by `set_fused_ops`: compiled on first use, or the CPU kernel `cpu_kernel` (same arguments, same
    results) when its first argument is on the CPU, or as is."""
    if fn is None:
        return functools.partial(fused_op, cpu_kernel=cpu_kernel)
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if cpu_kernel is not None and _cpu_kernels is not None and args[0].device.type == "cpu":
            return getattr(_cpu_kernels, cpu_kernel)(*args)
        if not _compiled:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args)

    return run
