"""A sequence's completion text as its tokens arrive, and its stop strings."""
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import SamplingParams

PROMPT_CONTEXT = 5
INCOMPLETE = "\ufffd"


@dataclass
class TextDelta:
    """New text to stream, and the stop string that ended the sequence in this update (None if none did)."""

    text: str
    stop: str | None = None


class IncrementalDetokenizer:
    """Detokenizes one sequence's completion incrementally, as vLLM does: `tokens[prefix:read]` decode to text
    already produced, and a new token's text is what `tokens[prefix:]` decode to beyond it. A few prompt tokens
    come first, so the first completion token decodes in context (a leading space stays). Text ending in U+FFFD, a
    multi-byte character whose bytes have not all arrived, waits for the next token.

    Stop strings are searched in the new text and the characters before it that a match ending in it could
    start in; the first match (earliest in the text, then first in `params.stop`) ends the sequence and cuts the
    text before it (after it with `include_stop_str_in_output`). Text of the first `min_tokens` tokens cannot end
    a match. The deltas never include text a later stop string could remove (a tail that begins one); the
    concatenated deltas are `text`, the final completion text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.tokens = self._to_tokens(prompt_token_ids[-PROMPT_CONTEXT:])
        if self._decode(self.tokens).endswith(INCOMPLETE):
            self.tokens = []
        self.prefix_offset, self.read_offset = 0, len(self.tokens)
        self.num_tokens = 0
        self.text = ""
        self.searched = 0
        self.emitted = 0

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        """Ids the tokenizer does not know (a vocabulary padded past the tokenizer, as Qwen's) are empty text, as in
        vLLM."""
        tokens = self.tokenizer.convert_ids_to_tokens(token_ids, skip_special_tokens=self.skip_special_tokens)
        return [token or "" for token in tokens]

    def _decode(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def _new_text(self, complete_only: bool) -> str:
        """The text of `tokens[read:]`; "" while it ends in an incomplete character, when `complete_only`."""
        done = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])
        if len(text) <= len(done) or (complete_only and text.endswith(INCOMPLETE)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text[len(done):]

    def update(self, token_ids: list[int], finished: bool = False) -> TextDelta:
        """Take the sequence's next token(s). `finished`: the engine ended the sequence with them (EOS, a stop
        token, max_tokens, abort), so everything held back is released, an incomplete character as U+FFFD. When the
        returned delta names a stop string, the sequence is finished; update it no further."""
        for token_id in token_ids:
            self.tokens += self._to_tokens([token_id])
            self.text += self._new_text(complete_only=True)
            self.num_tokens += 1
            if self.num_tokens <= self.min_tokens:
                self.searched = len(self.text)
        if finished:
            self.text += self._new_text(complete_only=False)
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
