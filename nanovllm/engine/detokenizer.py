"""A sequence's completion text as its tokens arrive, and its stop strings."""
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import SamplingParams

PROMPT_CONTEXT = 5
INCOMPLETE = "\ufffd"


@dataclass
class TextDelta:
    """New text to stream, and the stop string that ended the sequence in this update (None if none did)."""

    text: str
    stop: str | None = None


class PythonStream:
    """`DecodeStream`'s contract for tokenizers without a Rust backend, as vLLM's Python path: `tokens[prefix:read]`
    decode to text already produced, and a new token's text is what `tokens[prefix:]` decode to beyond it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = self._to_tokens(context)
        if self._decode(self.tokens).endswith(INCOMPLETE):
            self.tokens = []
        self.prefix_offset, self.read_offset = 0, len(self.tokens)

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        """Ids the tokenizer does not know (a vocabulary padded past the tokenizer, as Qwen's) are empty text, as in
        vLLM."""
        tokens = self.tokenizer.convert_ids_to_tokens(token_ids, skip_special_tokens=self.skip_special_tokens)
        return [token or "" for token in tokens]

    def _decode(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def step(self, token_ids: list[int]) -> str | None:
        """The new text, or None while it ends in an incomplete character."""
        self.tokens += self._to_tokens(token_ids)
        return self._new_text(complete_only=True) or None

    def flush(self) -> str:
        """What is held back, an incomplete character as U+FFFD."""
        return self._new_text(complete_only=False)

    def _new_text(self, complete_only: bool) -> str:
        done = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])
        if len(text) <= len(done) or (complete_only and text.endswith(INCOMPLETE)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text[len(done):]


class NativeStream:
    """The tokenizers library's `DecodeStream` (Rust, as vLLM V1 uses it), which returns None for ids it does not
    know, skipped special tokens and incomplete characters; those ids are kept to release at the end.

    With `spaces_between_special_tokens=False` (and special tokens kept), an added token that follows another one is
    its bare text, whatever space the decoder would put before it, as vLLM's fast detokenizer writes it."""

    def __init__(self, backend: Tokenizer, context: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True):
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        if backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(INCOMPLETE):
            context = []
        self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.held: list[int] = []
        self.added: dict[int, str] = {}  # added token id -> its text, where spaces between them are dropped
        if not (skip_special_tokens or spaces_between_special_tokens):
            self.added = {i: token.content for i, token in backend.get_added_tokens_decoder().items()}
        self.last_added = False

    def step(self, token_ids: list[int]) -> str | None:
        if self.added:
            texts = [self._step_one(i) for i in token_ids]
            return None if all(text is None for text in texts) else "".join(text or "" for text in texts)
        text = self.stream.step(self.backend, token_ids)
        if text is None:
            self.held += token_ids
        elif self.held:
            self.held = []
        return text

    def _step_one(self, token_id: int) -> str | None:
        text = self.stream.step(self.backend, token_id)
        added = self.added.get(token_id)
        if added is not None and self.last_added:
            text = added
        self.last_added = added is not None
        if text is None:
            self.held.append(token_id)
        elif self.held:
            self.held = []
        return text

    def flush(self) -> str:
        return self.backend.decode(self.held, skip_special_tokens=self.skip_special_tokens) if self.held else ""


class IncrementalDetokenizer:
    """Detokenizes one sequence's completion incrementally through a `NativeStream` (or, for a tokenizer without a
    Rust backend, a `PythonStream`). A few prompt tokens come first, so the first completion token decodes in
    context (a leading space stays). Text ending in an incomplete multi-byte character waits for the next token.

    Stop strings are searched in the new text and the characters before it that a match ending in it could
    start in; the first match (earliest in the text, then first in `params.stop`) ends the sequence and cuts the
    text before it (after it with `include_stop_str_in_output`). Text of the first `min_tokens` tokens cannot end
    a match. The deltas never include text a later stop string could remove (a tail that begins one); the
    concatenated deltas are `text`, the final completion text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams):
        context = prompt_token_ids[-PROMPT_CONTEXT:]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = (NativeStream(backend, context, params.skip_special_tokens,
                                    params.spaces_between_special_tokens) if isinstance(backend, Tokenizer)
                       else PythonStream(tokenizer, context, params.skip_special_tokens))
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        self.text = ""
        self.searched = 0
        self.emitted = 0

    def update(self, token_ids: list[int], finished: bool = False) -> TextDelta:
        """Take the sequence's next token(s). `finished`: the engine ended the sequence with them (EOS, a stop
        token, max_tokens, abort), so everything held back is released, an incomplete character as U+FFFD. When the
        returned delta names a stop string, the sequence is finished; update it no further."""
        within_min_tokens = min(len(token_ids), max(self.min_tokens - self.num_tokens, 0))
        self.num_tokens += len(token_ids)
        if within_min_tokens:  # their text cannot end a stop string
            self.text += self.stream.step(token_ids[:within_min_tokens]) or ""
            self.searched = len(self.text)
            token_ids = token_ids[within_min_tokens:]
        if token_ids:
            self.text += self.stream.step(token_ids) or ""
        if finished:
            self.text += self.stream.flush()
        if not self.stops:
            delta, self.emitted = self.text[self.emitted:], len(self.text)
            return TextDelta(delta)
        stop = self._find_stop()
        end = len(self.text) if finished or stop else len(self.text) - self._stop_prefix_length()
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return TextDelta(delta, stop)

    def _find_stop(self) -> str | None:
        matches = []
        for order, stop in enumerate(self.stops):
            start = self.text.find(stop, max(self.searched - len(stop) + 1, 0))
            if start != -1:
                matches.append((start, order, stop))
        self.searched = len(self.text)
        if not matches:
            return None
        start, _, stop = min(matches)
        self.text = self.text[:start + len(stop) if self.include_stop else start]
        return stop

    def _stop_prefix_length(self) -> int:
        """How much of the text's tail could begin a stop string, which would then be cut (none when kept)."""
        if self.include_stop:
            return 0
        return max((k for stop in self.stops for k in range(1, len(stop)) if self.text.endswith(stop[:k])), default=0)
