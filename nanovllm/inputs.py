"""vLLM's `vllm.inputs`: the prompt forms `LLM.generate` takes, as vLLM types them (`TextPrompt`, `TokensPrompt`, both
plain dicts, and `PromptType`). Types only: `nanovllm.engine.prompts` checks what is passed."""
from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine: `{"prompt": text}`."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt as token ids, `{"prompt_token_ids": ids}`, with the text they came from under "prompt" if the caller
    has it (the output's `prompt`; the ids are what runs)."""

    prompt: str


PromptType = str | TextPrompt | TokensPrompt
"""What one prompt may be, as vLLM types it (nanovllm also takes a bare list of token ids)."""

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
