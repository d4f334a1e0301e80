"""torch.compile for the small fused ops (norms, activation, rotary, sampler), switched on once at start-up.

The model runner turns it on only on CUDA without `enforce_eager`; elsewhere every op runs
eagerly, exactly as written, and torch's compiler is never even imported.
"""
import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_enabled = False


def set_compile(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def fused_op(fn: F) -> F:
    """`fn` run through `torch.compile` (compiled on first use) while compilation is on, else as is."""
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if not _enabled:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args)

    return run
