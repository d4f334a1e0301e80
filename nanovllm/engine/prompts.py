"""What users pass in, checked once, before any work starts, whoever runs it (one engine or data-parallel replicas): a
prompt becomes a `CheckedPrompt`, its constraint a `GrammarSpec` the engine compiles without checking it again."""
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.exceptions import VLLMValidationError
from nanovllm.logits_processor import validate_logits_processors_parameters
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_output.backends import check_constraint
from nanovllm.structured_output.spec import GrammarSpec

Prompt = str | list[int] | dict
"""Text; vLLM's `{"prompt": text}` or `{"prompt_token_ids": ids}`; or (nanovllm's shorthand) a list of token ids."""
Conversation = list[dict[str, str]]
Params = SamplingParams | list[SamplingParams] | None
LoRAParam = LoRARequest | list[LoRARequest | None] | None
"""`lora_request`: one adapter for every prompt, or one per prompt (None: the base model)."""


@dataclass
class CheckedPrompt:
    """A prompt ready to run: its text (if it came as text), token ids, sampling params (a copy, with `max_tokens`
    filled in), priority, its structured-output constraint as checked (None when unconstrained), and the LoRA adapter
    it runs under (None: the base model; checked by the engine, which loads it)."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    priority: int
    grammar: GrammarSpec | None = None
    lora_request: LoRARequest | None = None


def with_loras(checked: list[CheckedPrompt], lora_request: LoRAParam) -> list[CheckedPrompt]:
    """`checked` under the adapters `lora_request` names; a ValueError when a list of them is not one per prompt."""
    if lora_request is None:
        return checked
    loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(checked)
    if len(loras) != len(checked):
        raise VLLMValidationError(f"lora_request is a list of {len(loras)} but there are {len(checked)} prompts: give "
                                  "one for all prompts or one per prompt (None for the base model)")
    bad = next((r for r in loras if r is not None and not isinstance(r, LoRARequest)), None)
    if bad is not None:
        raise VLLMValidationError(f"lora_request must be a nanovllm.lora.request.LoRARequest (or None), got "
                                  f"{type(bad).__name__}")
    return [replace(c, lora_request=r) for c, r in zip(checked, loras)]


class PromptChecker:
    """Turns what users pass (`generate`'s prompts, `chat`'s conversations, sampling params, priorities) into
    `CheckedPrompt`s for `config`'s model and `tokenizer`, or a `VLLMValidationError` (a ValueError, as vLLM's)
    naming the problem."""

    def __init__(self, config: Config, tokenizer: PreTrainedTokenizerBase | None):
        self.config = config
        self.tokenizer = tokenizer

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def check_prompts(self, prompts: Prompt | list[Prompt], sampling_params: Params, priority: int | list[int] | None,
                      add_special_tokens: bool = True) -> list[CheckedPrompt]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise VLLMValidationError("prompts must be a prompt or a list of prompts (strings, {'prompt': ...} or "
                                      "{'prompt_token_ids': ...} dicts, or token-id lists), got "
                                      f"{type(prompts).__name__}")
        sampling_params = self._per_prompt("sampling params", sampling_params, len(prompts))
        priority = self._per_prompt("priorities", 0 if priority is None else priority, len(prompts))
        return [self.check_prompt(p, sp, pr, i, add_special_tokens)
                for i, (p, sp, pr) in enumerate(zip(prompts, sampling_params, priority))]

    def check_conversations(self, messages: Conversation | list[Conversation], sampling_params: Params,
                            priority: int | list[int] | None, add_generation_prompt: bool,
                            chat_template_kwargs: dict | None = None) -> list[CheckedPrompt]:
        """One conversation (a list of `{"role", "content"}` messages) or a list of them, through the chat template
        (given `chat_template_kwargs` besides the messages)."""
        if not isinstance(messages, (list, tuple)):
            raise _not_a_conversation(messages)
        single = bool(messages) and isinstance(messages[0], dict)
        prompts = [self.chat_text(c, add_generation_prompt, chat_template_kwargs)
                   for c in ([messages] if single else messages)]
        return self.check_prompts(prompts, sampling_params, priority, add_special_tokens=False)

    def chat_text(self, conversation: Conversation, add_generation_prompt: bool,
                  chat_template_kwargs: dict | None = None) -> str:
        if self.tokenizer is None:
            raise VLLMValidationError(f"{self.config.model!r} has no tokenizer, hence no chat template; pass token ids "
                                      "to generate() instead")
        if not self.tokenizer.chat_template:
            raise VLLMValidationError(f"{self.config.model!r} has no chat template (a base model?); use generate() "
                                      "with the prompt text instead")
        if not (isinstance(conversation, (list, tuple)) and conversation and all(
                isinstance(m, dict) and {"role", "content"} <= m.keys() for m in conversation)):
            raise _not_a_conversation(conversation)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise VLLMValidationError(f"chat_template_kwargs must be a dict or None, got {chat_template_kwargs!r}")
        return self.tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **(chat_template_kwargs or {}))

    def check_prompt(self, prompt: Prompt, params: SamplingParams | None, priority: int, index: int = 0,
                      add_special_tokens: bool = True) -> CheckedPrompt:
        text, token_ids = self._to_token_ids(prompt, index, add_special_tokens)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise VLLMValidationError("sampling_params must be a SamplingParams or a list of them (one per prompt), "
                                      f"got {type(params).__name__}")
        params.check_vocab(self.config.hf_config.vocab_size, self.config.max_logprobs)
        validate_logits_processors_parameters(self.config.logits_processors, params)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise VLLMValidationError(f"priority must be an int (lower runs first), got {priority!r}")
        if params.bad_words and self.tokenizer is None:
            raise VLLMValidationError(f"bad_words need a tokenizer and {self.config.model!r} has none")
        grammar = None
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise VLLMValidationError(f"structured outputs need a tokenizer and {self.config.model!r} has none")
            grammar = check_constraint(params.structured_outputs, self.config.structured_outputs_backend)
        params = replace(params, max_tokens=params.max_tokens or max(self.max_model_len - len(token_ids), 1))
        return CheckedPrompt(text, token_ids, params, priority, grammar)

    def _to_token_ids(self, prompt: Prompt, index: int,
                      add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """The prompt's text (if any) and validated token ids, so a bad prompt is rejected before any work starts."""
        text = None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown or not prompt:
                raise VLLMValidationError(f"prompt {index}: nanovllm takes {{'prompt': text}} or {{'prompt_token_ids': "
                                          f"ids}}, got keys {sorted(prompt)} (multimodal data and other inputs are not "
                                          "supported)")
            text = prompt.get("prompt")
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else text
        if isinstance(prompt, str):
            if self.tokenizer is None:
                why = ("you cannot pass text prompts when `skip_tokenizer_init=True`" if self.config.skip_tokenizer_init
                       else f"{self.config.model!r} has no tokenizer")
                raise VLLMValidationError(f"prompt {index} is text but {why}; pass token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            got = type(prompt).__name__
            if isinstance(prompt, (list, tuple)):
                item = next(t for t in prompt if isinstance(t, bool) or not isinstance(t, int))
                got = f"a {got} holding {type(item).__name__} {item!r}"
            raise VLLMValidationError(f"prompt {index} must be a string, {{'prompt': text}}, {{'prompt_token_ids': "
                                      f"ids}} or a list of token ids (ints), got {got}")
        if not token_ids:
            raise VLLMValidationError(f"prompt {index} is empty: the decoder prompt cannot be empty (every prompt "
                                      "needs at least one token)")
        if len(token_ids) > self.max_model_len:
            raise VLLMValidationError(f"prompt {index} (length {len(token_ids)}) is longer than the maximum model "
                                      f"length of {self.max_model_len} (max_model_len); {self._too_long_hint()}. "
                                      f"This model's maximum context length is {self.max_model_len} tokens, which the "
                                      "prompt exceeds even without any output tokens")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise VLLMValidationError(f"prompt {index}: token id {bad[0]} is out of vocabulary [0, {vocab_size})")
        return text, token_ids

    def _too_long_hint(self) -> str:
        limit = self.config.hf_config.max_position_embeddings
        if self.max_model_len >= limit:
            return f"the model handles at most {limit} tokens, so shorten the prompt"
        return (f"shorten the prompt, or start the LLM with a larger max_model_len (up to the model's {limit}; the KV "
                "cache must hold one such sequence: cpu_kvcache_gib on CPU, gpu_memory_utilization on CUDA)")

    @staticmethod
    def _per_prompt(name: str, value, num_prompts: int) -> list:
        if not isinstance(value, (list, tuple)):
            return [value] * num_prompts
        if len(value) != num_prompts:
            raise VLLMValidationError(f"got {num_prompts} prompts but {len(value)} {name}; pass one value or one per "
                                      "prompt")
        return list(value)


def _not_a_conversation(messages) -> VLLMValidationError:
    hint = "; to send text as it is, use generate()" if isinstance(messages, str) else ""
    return VLLMValidationError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} "
                               f"dicts) or a list of conversations, got {messages!r}{hint}")
