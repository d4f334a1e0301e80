"""Pooling requests' prompts and params, checked once before any work starts, as `nanovllm.engine.prompts` checks
generation's: the prompt forms `generate` takes, truncated when `truncate_prompt_tokens` says so, text pairs for a
cross-encoder, and `PoolingParams` against the task and the model."""
from dataclasses import dataclass

from nanovllm.engine.prompts import CheckedPrompt, Prompt, PromptChecker
from nanovllm.models.hf_config import reads_token_types
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams

PoolingParamsArg = PoolingParams | list[PoolingParams] | None
POOLED_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)
"""The sampling params a pooling request's sequence carries: it never samples."""


@dataclass
class CheckedPoolingPrompt(CheckedPrompt):
    """A checked pooling prompt: `pooling` is its `PoolingParams` for its task, the model's defaults filled in;
    `params` is `POOLED_SAMPLING`. `token_type_ids`: a text pair's token types, for a model that reads them (BERT's
    second text is type 1); None: all 0."""

    pooling: PoolingParams | None = None
    token_type_ids: list[int] | None = None


class PoolingPromptChecker(PromptChecker):
    """`PromptChecker` for a pooling engine: turns `embed`'s, `classify`'s, `score`'s ... prompts and params into
    `CheckedPoolingPrompt`s, or a ValueError naming the problem; a prompt to generate from is refused."""

    def check_prompt(self, *args, **kwargs) -> CheckedPrompt:
        raise self._cannot_generate()

    def check_prompts(self, *args, **kwargs) -> list[CheckedPrompt]:
        raise self._cannot_generate()

    def check_conversations(self, *args, **kwargs) -> list[CheckedPrompt]:
        raise self._cannot_generate()

    def _cannot_generate(self) -> ValueError:
        return ValueError(f"{self.config.model!r} runs with runner='pooling', which does not generate: use embed, "
                          "classify, score, reward or encode, or start the LLM with runner='generate' (a model with "
                          "an LM head)")

    def check_pooling_prompts(self, prompts: Prompt | list[Prompt], params: PoolingParamsArg, task: str,
                              truncate_prompt_tokens: int | None) -> list[CheckedPoolingPrompt]:
        """Prompts as `generate` takes them, with one `PoolingParams` for all or one per prompt (None: the
        defaults); `truncate_prompt_tokens`, when given, replaces theirs."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts (strings, {{'prompt': ...}} or "
                             f"{{'prompt_token_ids': ...}} dicts, or token-id lists), got {type(prompts).__name__}")
        params = self._per_prompt("pooling params", params, len(prompts))
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            pooling = self.pooling_params(p, task, truncate_prompt_tokens)
            text, token_ids = self._untruncated(prompt, i)
            token_ids = self._truncated(token_ids, pooling.truncate_prompt_tokens)
            _, token_ids = self._to_token_ids(token_ids, i)
            checked.append(CheckedPoolingPrompt(text, token_ids, POOLED_SAMPLING, 0, pooling=pooling))
        return checked

    def check_pair(self, text_1: str, text_2: str, params: PoolingParams | None, index: int,
                   truncate_prompt_tokens: int | None) -> CheckedPoolingPrompt:
        """A text pair for a cross-encoder's `score`, joined as the tokenizer joins a pair (its special tokens and
        separators, as transformers' `tokenizer(text_1, text_2)`)."""
        pooling = self.pooling_params(params, "score", truncate_prompt_tokens)
        if self.tokenizer is None:
            raise ValueError(f"score needs a tokenizer to join text pairs and {self.config.model!r} has none")
        if not isinstance(text_1, str) or not isinstance(text_2, str):
            raise ValueError(f"pair {index}: score takes texts (strings), got {type(text_1).__name__} and "
                             f"{type(text_2).__name__}")
        if not text_1 or not text_2:
            raise ValueError(f"pair {index}: an empty text cannot be scored")
        reads_types = reads_token_types(self.config.hf_config)
        encoded = self.tokenizer(text_1, text_2, return_token_type_ids=reads_types)
        token_ids = self._truncated(encoded["input_ids"], pooling.truncate_prompt_tokens)
        _, token_ids = self._to_token_ids(token_ids, index)
        types = encoded["token_type_ids"] if reads_types else None
        types = self._truncated(types, pooling.truncate_prompt_tokens) if types and any(types) else None
        return CheckedPoolingPrompt(None, token_ids, POOLED_SAMPLING, 0, pooling=pooling, token_type_ids=types)

    def pooling_params(self, params: PoolingParams | None, task: str,
                       truncate_prompt_tokens: int | None) -> PoolingParams:
        """`params` for `task` with the model's defaults; a ValueError for what the model or the task cannot take
        (vLLM's words for `dimensions` and `truncate_prompt_tokens`)."""
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams or a list of them (one per prompt), got "
                             f"{type(params).__name__}")
        pooler = self.config.pooler
        params = params.for_task(task, truncate_prompt_tokens, pooler.normalize)
        k = params.truncate_prompt_tokens
        if k is not None and k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                             f"({self.max_model_len}). Please, select a smaller truncation size.")
        if params.dimensions is not None:
            if not pooler.is_matryoshka:
                raise ValueError(f'Model "{self.config.model}" does not support matryoshka representation, changing '
                                 "output dimensions will lead to poor results (leave dimensions unset)")
            dims = pooler.matryoshka_dimensions
            if dims is not None and params.dimensions not in dims:
                raise ValueError(f'Model "{self.config.model}" only supports {list(dims)} matryoshka dimensions, '
                                 f"use other output dimensions will lead to poor results (got {params.dimensions})")
        return params

    def _untruncated(self, prompt: Prompt, index: int) -> tuple[str | None, Prompt]:
        """The prompt's text (if any) and its token ids (text tokenized; other forms as they are, checked later)."""
        text = None
        if isinstance(prompt, dict) and prompt and set(prompt) <= {"prompt", "prompt_token_ids"}:
            text = prompt.get("prompt")
            prompt = prompt.get("prompt_token_ids", text)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text but {self.config.model!r} has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        return text, prompt

    def _truncated(self, token_ids: Prompt, truncate: int | None) -> Prompt:
        """vLLM's truncation: the last `truncate` tokens (-1: `max_model_len`)."""
        if truncate is None or not isinstance(token_ids, (list, tuple)):
            return token_ids
        return list(token_ids)[-(self.max_model_len if truncate == -1 else truncate):]
