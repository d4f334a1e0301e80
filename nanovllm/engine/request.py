"""A user's request as the user sees it: the `n` sequences sampling one prompt, their text and log-probabilities."""
import os
import time
from copy import copy

from transformers import PreTrainedTokenizerBase

from nanovllm.core.sequence import Sequence
from nanovllm.engine.detokenizer import INCOMPLETE, IncrementalDetokenizer
from nanovllm.logprobs import FlatLogprobs
from nanovllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from nanovllm.sampling_params import SamplingParams


class Completion:
    """One sequence's output so far: text from its incremental detokenizer, and what was already reported.

    Without stop strings to watch, tokens reach the detokenizer only when somebody reads `text` (a stream's delta,
    an output), many in one call: `generate` pays for detokenizing once per request, not once per token.
    """

    def __init__(self, index: int, seq: Sequence, tokenizer: PreTrainedTokenizerBase | None):
        self.index = index
        self.seq = seq
        self.tokenizer = tokenizer if seq.params.detokenize else None
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.token_ids, seq.params) if self.tokenizer else None
        self._text = ""
        self._undecoded: list[int] = []
        self._ending_undecoded = False
        self.logprobs: list[dict[int, Logprob]] | None = [] if seq.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.reported_tokens = self.reported_text = 0
        self.reported_finish = False

    def update(self, logprobs: TokenLogprobs | None, ending: tuple[str, int | None] | None,
               token_is_text: bool = False) -> str | None:
        """Take the token the sequence just got, which `ending` (if not None) ends it; returns the stop string its
        text completed, if any. An ending stop token or EOS adds no text unless `include_stop_str_in_output`; a
        token that ends the sequence as text (`token_is_text`: the last of a completed grammar) does."""
        seq, token_id = self.seq, self.seq.token_ids[-1]
        if logprobs is not None:
            self.cumulative_logprob += logprobs.logprob
            self.logprobs.append(ranked_logprobs(token_id, logprobs, self.tokenizer, seq.token_ids[-1 - CONTEXT:-1]))
        if self.detokenizer is None:
            return None
        if token_is_text or not (ending is not None and ending[0] == "stop"
                                 and not seq.params.include_stop_str_in_output):
            self._undecoded.append(token_id)
        self._ending_undecoded = ending is not None
        return self._decode() if seq.params.stop else None

    @property
    def text(self) -> str:
        if self._undecoded or self._ending_undecoded:
            self._decode()
        return self._text

    def _decode(self) -> str | None:
        """Detokenize the tokens taken since the last call; returns the stop string their text completed, if any."""
        delta = self.detokenizer.update(self._undecoded, finished=self._ending_undecoded)
        self._undecoded, self._ending_undecoded = [], False
        self._text += delta.text
        return delta.stop

    @property
    def has_news(self) -> bool:
        """Whether tokens, text or the finish are still unreported (to a stream)."""
        return (self.seq.num_completion_tokens > self.reported_tokens or len(self.text) > self.reported_text
                or self.seq.is_finished and not self.reported_finish)

    def output(self, delta: bool) -> CompletionOutput:
        """Everything so far, or (with `delta`) what is new since the last delta."""
        seq = self.seq
        tokens, text = seq.completion_token_ids, self.text
        logprobs = self.logprobs
        if delta:
            tokens, text = tokens[self.reported_tokens:], text[self.reported_text:]
            logprobs = None if logprobs is None else logprobs[self.reported_tokens:]
            self.reported_tokens, self.reported_text = seq.num_completion_tokens, len(self.text)
            self.reported_finish = seq.is_finished
        if logprobs is not None and seq.params.flat_logprobs:
            logprobs = FlatLogprobs.of(logprobs)
        return CompletionOutput(self.index, text, tokens, None if logprobs is None else self.cumulative_logprob,
                                logprobs, seq.finish_reason, seq.stop_reason)


CONTEXT = 4
"""How many tokens before a logprob's position `decoded_token` may read to complete a character (vLLM's 4)."""


def ranked_logprobs(token_id: int, logprobs: TokenLogprobs, tokenizer: PreTrainedTokenizerBase | None,
                    context: list[int]) -> dict[int, Logprob]:
    """vLLM's order: the chosen token first, then the most likely ones by rank; each token's text as
    `decoded_token` gives it after `context`, the tokens before the position."""
    ranked = {token_id: (logprobs.logprob, logprobs.rank)}
    for rank, (top_id, top_logprob) in enumerate(zip(logprobs.top_ids, logprobs.top_logprobs), start=1):
        ranked.setdefault(top_id, (top_logprob, rank))
    return {t: Logprob(lp, rank, decoded_token(tokenizer, t, context) if tokenizer else None)
            for t, (lp, rank) in ranked.items()}


def decoded_token(tokenizer: PreTrainedTokenizerBase, token_id: int, context: list[int]) -> str:
    """A token's text, as vLLM's logprobs give it: a token that decodes to an incomplete UTF-8 character (byte
    fallback splits characters over tokens) is decoded after the fewest of the `context` tokens before it (the last
    `CONTEXT`) that complete it, and its text is what it adds to theirs, the bytes it completes included; "" when no
    such context completes it."""
    text = tokenizer.decode([token_id])
    if not text.endswith(INCOMPLETE):
        return text
    for n in range(1, min(len(context), CONTEXT) + 1):
        before = context[-n:]
        full = tokenizer.decode(before + [token_id])
        if full.endswith(INCOMPLETE):
            continue
        clean = len(before)  # the context tokens that are whole characters; the bytes after them are this token's
        while clean and tokenizer.decode([before[clean - 1]]).endswith(INCOMPLETE):
            clean -= 1
        prefix = tokenizer.decode(before[:clean]) if clean else ""
        return full[len(os.path.commonprefix([prefix, full])):]
    return ""


class Request:
    """The `n` sequences of one prompt (sample i seeded with `seed + i`, as vLLM) and their completions.

    `error` is set when the engine aborted the request because a step failed; the caller that waits for it raises.
    """

    def __init__(self, request_id: str, prompt: str | None, seqs: list[Sequence],
                 tokenizer: PreTrainedTokenizerBase | None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = seqs[0].token_ids[:seqs[0].num_prompt_tokens]
        self.completions = [Completion(i, seq, tokenizer) for i, seq in enumerate(seqs)]
        self.tokenizer = tokenizer if seqs[0].params.detokenize else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._prompt_scores: dict[int, dict[int, Logprob]] = {}  # prompt position -> its token's logprobs
        self.metrics = RequestMetrics(time.time(), num_prompt_tokens=len(self.prompt_token_ids))
        self.error: BaseException | None = None
        self.lora_request = None  # the LoRARequest it runs under (None: the base model)

    @staticmethod
    def sample_params(params: SamplingParams) -> list[SamplingParams]:
        return [params.for_sample(i) for i in range(params.n)] if params.n > 1 else [params]

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.completions]

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    @property
    def has_news(self) -> bool:
        return any(c.has_news for c in self.completions)

    def add_prompt_logprobs(self, first: int, logprobs: list[TokenLogprobs]) -> None:
        """Record the log-probabilities of prompt tokens `first + 1`, `first + 2`, ... (a prefill chunk's share; a
        recomputed chunk, after preemption or from another sample, changes nothing)."""
        for position, lp in enumerate(logprobs, start=first + 1):
            if position not in self._prompt_scores:
                before = self.prompt_token_ids[max(position - CONTEXT, 0):position]
                self._prompt_scores[position] = ranked_logprobs(self.prompt_token_ids[position], lp, self.tokenizer,
                                                                before)
        if self.prompt_logprobs is None and len(self._prompt_scores) == len(self.prompt_token_ids) - 1:
            self.prompt_logprobs = [None] + [self._prompt_scores[p] for p in range(1, len(self.prompt_token_ids))]

    def record_token(self, now: float) -> None:
        """It got tokens in the step that ended at `now`."""
        metrics = self.metrics
        if not metrics.first_token_ts:
            metrics.first_token_ts = now
            metrics.first_token_latency = now - metrics.arrival_time
        metrics.last_token_ts = now

    def current_metrics(self) -> RequestMetrics:
        """A copy of the metrics with the counts as they are now (each output keeps its own)."""
        metrics = copy(self.metrics)
        metrics.num_generation_tokens = sum(c.seq.num_completion_tokens for c in self.completions)
        metrics.num_cached_tokens = max(self.completions[0].seq.num_cached_tokens, 0)
        return metrics

    def take_news(self) -> list[RequestOutput]:
        """What a stream has not read yet: one output with the completions' news since the last delta, or none."""
        return [self.output(delta=True)] if self.has_news else []

    def output(self, delta: bool = False) -> RequestOutput:
        """The request's outputs: cumulative, or only the completions with news since the last delta."""
        completions = self.completions
        if delta:
            completions = [c for c in completions if c.has_news]
        metrics = self.current_metrics()
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and self.completions[0].seq.params.flat_logprobs:
            prompt_logprobs = FlatLogprobs.of(prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.output(delta) for c in completions], self.finished, prompt_logprobs,
                             metrics.num_cached_tokens, metrics, self.lora_request)
