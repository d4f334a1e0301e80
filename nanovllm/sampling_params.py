import copy
import math
import warnings
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import Any, Callable, ClassVar

from nanovllm.beam_search import BeamSearchParams  # noqa: F401 (vLLM's import path: vllm.sampling_params)
from nanovllm.exceptions import VLLMValidationError

MIN_TEMPERATURE = 0.01


def _number(name: str, value, valid: str, ok: Callable[[float], bool]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise VLLMValidationError(f"{name} must be a number {valid}, got {value!r}")
    return float(value)


def _integer(name: str, value, valid: str, ok: Callable[[int], bool]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise VLLMValidationError(f"{name} must be an integer {valid}, got {value!r}")
    return value


def _flag(name: str, value, none: bool = False) -> bool | None:
    if not (isinstance(value, bool) or none and value is None):
        raise VLLMValidationError(f"{name} must be True{', False or None' if none else ' or False'}, got {value!r}")
    return value


def _stop_strings(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise VLLMValidationError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
    return list(stops)


def _token_ids(name: str, ids) -> list[int]:
    ids = [] if ids is None else ids
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                     for t in ids):
        raise VLLMValidationError(f"{name} must be a list of token ids (integers >= 0), got {ids!r}")
    return list(ids)


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint every completion token must keep to, as vLLM's (exactly one kind): `json`, a JSON schema (dict or
    its text); `regex`; `choice`, a list of strings (the output is one of them); `grammar`, an EBNF / GBNF / Lark
    grammar (Lark unless a rule is defined with `::=`); `json_object=True`, any JSON object; `structural_tag`, vLLM's
    structural tag (JSON text with `structures` and `triggers`). `disable_any_whitespace` writes JSON without optional
    whitespace; `whitespace_pattern` is a regex for JSON's optional whitespace.

    `disable_additional_properties`: None (the default) compiles a schema as vLLM's default backend does (xgrammar's
    strict mode), on either backend: an object that names its properties and says nothing of others takes no other
    key, and a `prefixItems` tuple that says nothing of more items takes no more; True is the same. False leaves them
    open, as JSON Schema itself (and llguidance, vLLM's "guidance" backend, by default) reads them. A schema's own
    `additionalProperties` / `items` always rule. The constraint itself is checked (schema, regex, grammar) when the
    request is submitted, by the engine's grammar backend."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        count = sum(getattr(self, kind) is not None for kind in CONSTRAINT_KINDS)
        if count > 1:
            raise VLLMValidationError("You can only use one kind of structured outputs constraint but multiple are "
                                      f"specified: {self.__dict__}")
        if count < 1:
            raise VLLMValidationError("You must use one kind of structured outputs constraint but none are specified: "
                                      f"{self.__dict__}")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise VLLMValidationError(f"structured_outputs.{name} must be a string, got {getattr(self, name)!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise VLLMValidationError("structured_outputs.json must be a JSON schema as a dict or a string, got "
                                      f"{self.json!r}")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            raise VLLMValidationError("structured_outputs.choice must be a non-empty list of strings, got "
                                      f"{self.choice!r}")
        if self.json_object is not None and self.json_object is not True:
            raise VLLMValidationError("structured_outputs.json_object must be True (or left None), got "
                                      f"{self.json_object!r}")
        _flag("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        _flag("structured_outputs.disable_additional_properties", self.disable_additional_properties, none=True)

    @property
    def kind(self) -> str:
        """The constraint's kind: the name of the one field that is set."""
        return next(kind for kind in CONSTRAINT_KINDS if getattr(self, kind) is not None)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops: vLLM's names, defaults and valid ranges.

    `temperature=0` is greedy (exact argmax); temperatures in (0, 0.01) are raised to 0.01 with a
    warning, as vLLM does, since smaller ones overflow. `top_k` -1 or 0 is off (0 is stored as -1).
    `stop` strings end the completion, which is cut before the matched string (or keeps it with
    `include_stop_str_in_output`); `stop_token_ids` end it like EOS. Neither EOS, stop tokens nor stop
    strings end a completion before `min_tokens` tokens. `repetition_penalty` divides positive and
    multiplies negative logits of every token in the prompt or the completion so far;
    `presence_penalty` and `frequency_penalty` are subtracted (once, or once per occurrence) for
    tokens in the completion. `logprobs=k` returns, with each sampled token, its log-probability and
    rank and the k most likely tokens' (log-softmax of the model's raw logits; -1: the whole
    vocabulary); `prompt_logprobs=k` the same for every prompt token after the first; `flat_logprobs=True`
    returns both as vLLM's `nanovllm.logprobs.FlatLogprobs` instead of lists of dicts.
    `max_tokens=None` generates until `max_model_len`. `allowed_token_ids` restricts sampling to
    those ids; `bad_words` are never generated (a word's last token is banned wherever the
    completion so far ends with the word's other tokens, with or without a leading space).
    `detokenize=False` returns token ids only (no text, so no stop strings). `spaces_between_special_tokens=False`
    (with `skip_special_tokens=False`) writes a special token that follows another one as its bare text, as vLLM's
    detokenizer does, where a tokenizer's decoder would put a space between them.
    `structured_outputs` constrains the completion to a JSON schema, regex, choice or grammar (see
    `StructuredOutputsParams`); a completion whose constraint is complete ends there with `finish_reason="stop"`.
    `best_of` is vLLM's field, checked as vLLM checks it (None, or an integer >= `n`), and as in vLLM V1 a request
    with `best_of` > 1 is refused at submission (a ValueError).
    `extra_args` (a dict, vLLM's) holds per-request arguments for the engine's custom logits processors
    (`LLM(logits_processors=[...])`), which may refuse them at submission. Per-request `logits_processors` are
    refused, a ValueError in vLLM V1's words: V1 takes logits processor classes for the engine instead.

    As vLLM's (a msgspec struct), the class lists its constructor's fields in `__struct_fields__`, so that
    `SamplingParams(**{f: getattr(p, f) for f in p.__struct_fields__})` rebuilds `p`; `clone()` is a deep copy.
    """

    __struct_fields__: ClassVar[tuple[str, ...]]
    """The constructor's fields, in order, under msgspec's name for them (set below the class)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    flat_logprobs: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    best_of: int | None = None
    extra_args: dict[str, Any] | None = None
    logits_processors: InitVar[Any] = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)
    """`bad_words` as token-id sequences, filled in by the engine from the model's tokenizer."""

    def __post_init__(self, logits_processors: Any = None) -> None:
        if logits_processors:
            raise VLLMValidationError("vLLM V1 does not support per request user provided logits processors. Pass "
                                      "logits processor classes to the engine, LLM(logits_processors=[...]), with "
                                      "per-request arguments in SamplingParams(extra_args={...}); a per-request "
                                      "callable runs through "
                                      "nanovllm.v1.sample.logits_processor.AdapterLogitsProcessor")
        self.n = _integer("n", self.n, ">= 1", lambda v: v >= 1)
        self.temperature = _number("temperature", self.temperature, ">= 0 (0 is greedy)", lambda v: v >= 0)
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, where sampling overflows; "
                          f"using {MIN_TEMPERATURE} (use 0 for greedy decoding)", UserWarning, stacklevel=3)
            self.temperature = MIN_TEMPERATURE
        self.top_p = _number("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        self.top_k = _integer("top_k", self.top_k, ">= 1, or -1 or 0 for all tokens", lambda v: v >= -1) or -1
        self.min_p = _number("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, "in [-2**63, 2**64), or None",
                                 lambda v: -2**63 <= v < 2**64)
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        self.include_stop_str_in_output = _flag("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.max_tokens is not None:
            self.max_tokens = _integer("max_tokens", self.max_tokens, ">= 1, or None (up to max_model_len)",
                                       lambda v: v >= 1)
        self.min_tokens = _integer("min_tokens", self.min_tokens, ">= 0", lambda v: v >= 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise VLLMValidationError(f"min_tokens must be at most max_tokens, got min_tokens={self.min_tokens} and "
                                      f"max_tokens={self.max_tokens}")
        self.ignore_eos = _flag("ignore_eos", self.ignore_eos)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, "> 0 (1 is off)",
                                          lambda v: v > 0)
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, "in [-2, 2]",
                                        lambda v: -2 <= v <= 2)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, "in [-2, 2]",
                                         lambda v: -2 <= v <= 2)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name), ">= 0, -1 for the whole vocabulary, or None",
                                             lambda v: v >= -1))
        self.flat_logprobs = _flag("flat_logprobs", self.flat_logprobs)
        self.skip_special_tokens = _flag("skip_special_tokens", self.skip_special_tokens)
        self.spaces_between_special_tokens = _flag("spaces_between_special_tokens",
                                                   self.spaces_between_special_tokens)
        self.detokenize = _flag("detokenize", self.detokenize)
        if self.stop and not self.detokenize:
            raise VLLMValidationError("stop strings need the text: they cannot be used with detokenize=False "
                                      "(use stop_token_ids)")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise VLLMValidationError("allowed_token_ids must not be empty (None allows every token)")
        if self.bad_words is not None and not (isinstance(self.bad_words, (list, tuple)) and all(
                isinstance(w, str) and w for w in self.bad_words)):
            raise VLLMValidationError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise VLLMValidationError("structured_outputs must be a StructuredOutputsParams (from nanovllm import "
                                      f"StructuredOutputsParams), got {type(self.structured_outputs).__name__}")
        if self.best_of is not None:
            self.best_of = _integer("best_of", self.best_of, ">= 1, or None", lambda v: v >= 1)
            if self.best_of < self.n:
                raise VLLMValidationError(f"best_of must be greater than or equal to n, got n={self.n} and "
                                          f"best_of={self.best_of}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise VLLMValidationError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def check_vocab(self, vocab_size: int, max_logprobs: int) -> None:
        """Reject, at submission (before any work), what the engine does not serve: `best_of` > 1 (as vLLM V1), token
        ids outside the model's vocabulary, and logprobs counts beyond it or the engine's `max_logprobs` (-1: no cap).
        Each message starts with vLLM's own words where vLLM has the check."""
        if self.best_of is not None and self.best_of > 1:
            raise VLLMValidationError("vLLM V1 does not yet support best_of, and neither does nanovllm (got "
                                      f"best_of={self.best_of}): ask for n={self.best_of} with logprobs=0 and keep the "
                                      "completions with the highest cumulative_logprob")
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or () if t >= vocab_size]
            if bad:
                raise VLLMValidationError(f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            count = vocab_size if value == -1 else value
            allowed = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
            if count <= allowed:
                continue
            vllm = f"Requested {'sample' if name == 'logprobs' else 'prompt'} logprobs of {count}, which is greater " \
                   f"than max allowed: {allowed}"
            if count > vocab_size:
                raise VLLMValidationError(f"{vllm} ({name} must be at most the vocabulary size {vocab_size}, got "
                                          f"{value})")
            raise VLLMValidationError(f"{vllm} ({name}={value} asks for {count} log-probabilities per token, more than "
                                      f"the engine's max_logprobs={max_logprobs}; create the LLM with a larger "
                                      "max_logprobs, -1 for no limit)")

    def clone(self) -> "SamplingParams":
        """A deep copy, as vLLM's `SamplingParams.clone`."""
        return copy.deepcopy(self)

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of the `index`-th of the `n` samples of one prompt: n=1, and with a seed, seed + index (as
        vLLM), so that seeded samples differ from each other yet each is reproducible."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


SamplingParams.__struct_fields__ = tuple(f.name for f in fields(SamplingParams) if f.init)
