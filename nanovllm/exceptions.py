"""vLLM's `vllm.exceptions`: the error invalid input to a request raises."""
from typing import Any


class VLLMValidationError(ValueError):
    """A request's input is invalid (a prompt, its sampling params, a priority, ...): raised before any work starts,
    as vLLM raises it for request validation. A ValueError, so code that catches ValueError catches it too.
    `parameter` and `value` (vLLM's) may name what was refused; they are added to the message when given."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        extras = [f"{name}={v}" for name, v in (("parameter", self.parameter), ("value", self.value))
                  if v is not None]
        return f"{super().__str__()} ({', '.join(extras)})" if extras else super().__str__()
