"""vLLM's `vllm.tokenizers`: `get_tokenizer`, which clients (lm-eval) call to load the tokenizer of the model they
hand to `LLM`."""
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

TOKENIZER_MODES = ("auto", "hf")  # vLLM's modes that load the Hugging Face tokenizer, the one nanovllm runs


def get_tokenizer(tokenizer_name: str | os.PathLike, *args, trust_remote_code: bool = False,
                  revision: str | None = None, download_dir: str | None = None, tokenizer_mode: str = "auto",
                  **kwargs) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer of `tokenizer_name` (a model directory), loaded as vLLM's `get_tokenizer` loads it
    for a generating model: `AutoTokenizer.from_pretrained` with the arguments given and, unless they say otherwise,
    `truncation_side="left"`. `tokenizer_mode` is "auto" or "hf" (vLLM's other modes are tokenizers nanovllm does not
    run: a ValueError)."""
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode must be one of {list(TOKENIZER_MODES)} (the Hugging Face tokenizer), got "
                         f"{tokenizer_mode!r}")
    kwargs.setdefault("truncation_side", "left")
    return AutoTokenizer.from_pretrained(str(tokenizer_name), *args, trust_remote_code=trust_remote_code,
                                         revision=revision, cache_dir=download_dir, **kwargs)


__all__ = ["get_tokenizer"]
