"""Triton kernels compiled (not run) for an NVIDIA GPU, with the argument types and the divisibility hints the JIT
would give them: catches what the interpreter accepts but the compiler does not. Needs no GPU, only a Triton build
with its NVIDIA backend (`require_nvidia_backend` skips the test otherwise)."""
from collections.abc import Callable, Iterable

import pytest
import torch

ELEMENT = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def require_nvidia_backend() -> None:
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")


def _pointer_arguments(param) -> bool:
    return param.name.endswith("_ptr")


def compile_for_nvidia(kernels: Iterable[tuple], capability: int, types: dict[str, str], other_pointers: str,
                       hinted: Callable = _pointer_arguments) -> None:
    """Compile each (kernel, constants[, launch options]) of `kernels` for compute capability `capability`: each
    parameter typed by `types`, else `other_pointers` for a `*_ptr` and i32 for the rest; the parameters `hinted`
    says are divisible by 16."""
    import triton.compiler
    from triton.backends.compiler import GPUTarget

    for kernel, constants, *launch in kernels:
        signature = {param.name: "constexpr" if param.name in constants
                     else types.get(param.name, other_pointers if param.name.endswith("_ptr") else "i32")
                     for param in kernel.params}
        hints = {(param.num,): [["tt.divisibility", 16]] for param in kernel.params if hinted(param)}
        triton.compiler.compile(triton.compiler.ASTSource(kernel, signature, constants, hints),
                                target=GPUTarget("cuda", capability, 32), options=launch[0] if launch else None)
