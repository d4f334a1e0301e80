"""vLLM's `vllm.renderers.hf`: `resolve_chat_template`, which clients (lm-eval) call to find the chat template that
`LLM.chat` applies."""
import logging
from typing import Any

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("nanovllm")


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase, chat_template: str | None,
                          tools: list[dict[str, Any]] | None, *, model_config: Any = None) -> str | None:
    """The chat template for `tokenizer`, as vLLM resolves it for a text model: `chat_template` when given (a
    template's name, such as "tool_use", looked up in the tokenizer's), else the tokenizer's own (the one for
    `tools` where it has several), else None. vLLM looks at a multimodal processor's template first and at
    templates it ships for some models last; nanovllm runs text models only and ships none. `model_config` is
    vLLM's argument (`LLM.llm_engine.model_config`), unused here."""
    if chat_template is not None:
        return tokenizer.get_chat_template(chat_template, tools=tools)
    try:
        return tokenizer.get_chat_template(chat_template, tools=tools)
    except Exception:  # no template (a base model): vLLM's fallbacks would come next
        logger.debug("no chat template in the tokenizer of %s", tokenizer.name_or_path, exc_info=True)
        return None


__all__ = ["resolve_chat_template"]
