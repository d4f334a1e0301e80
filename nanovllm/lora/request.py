"""vLLM's `vllm.lora.request`: `LoRARequest`, the request for a LoRA adapter, with vLLM's fields and checks. Pass one
to `LLM.generate`, `chat`, `stream` or `add_request` (with `LLM(..., enable_lora=True)`); lm-eval builds one when
asked for an adapter."""
from dataclasses import dataclass


@dataclass(eq=False)
class LoRARequest:
    """A LoRA adapter by name, id (> 0, unique per adapter) and path, as vLLM's; equal and hashed by name, as vLLM's."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.__class__) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


__all__ = ["LoRARequest"]
