"""A user's request as the user sees it: the `n` sequences sampling one prompt, their text and log-probabilities."""
from transformers import PreTrainedTokenizerBase

from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.core.sequence import Sequence
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from nanovllm.sampling_params import SamplingParams


class Completion:
    """One sequence's output so far: text from its incremental detokenizer, and what was already reported."""

    def __init__(self, index: int, seq: Sequence, tokenizer: PreTrainedTokenizerBase | None):
        self.index = index
        self.seq = seq
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.token_ids, seq.params) if tokenizer else None
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if seq.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.reported_tokens = self.reported_text = 0

    def update(self, logprobs: TokenLogprobs | None) -> str | None:
        """Take the token the sequence just got; returns the stop string it completed, if any."""
        seq, token_id = self.seq, self.seq.token_ids[-1]
        if logprobs is not None:
            self.cumulative_logprob += logprobs.logprob
            ranked = dict(zip(logprobs.top_ids, zip(logprobs.top_logprobs, range(1, len(logprobs.top_ids) + 1))))
            ranked[token_id] = (logprobs.logprob, logprobs.rank)
            self.logprobs.append({t: Logprob(lp, rank, self._decode(t)) for t, (lp, rank) in ranked.items()})
        if self.detokenizer is None:
            return None
        stop_token = seq.finish_reason == "stop" and not seq.params.include_stop_str_in_output
        delta = self.detokenizer.update([] if stop_token else [token_id], finished=seq.is_finished)
        self.text += delta.text
        return delta.stop

    def _decode(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer else None

    def output(self, delta: bool) -> CompletionOutput:
        """Everything so far, or (with `delta`) what is new since the last delta."""
        seq = self.seq
        tokens, text = seq.completion_token_ids, self.text
        logprobs = self.logprobs
        if delta:
            tokens, text = tokens[self.reported_tokens:], text[self.reported_text:]
            logprobs = None if logprobs is None else logprobs[self.reported_tokens:]
            self.reported_tokens, self.reported_text = seq.num_completion_tokens, len(self.text)
        return CompletionOutput(self.index, text, tokens, None if logprobs is None else self.cumulative_logprob,
                                logprobs, seq.finish_reason, seq.stop_reason)


class Request:
    """The `n` sequences of one prompt (sample i seeded with `seed + i`, as vLLM) and their completions."""

    def __init__(self, request_id: int, prompt: str | None, seqs: list[Sequence],
                 tokenizer: PreTrainedTokenizerBase | None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = seqs[0].token_ids[:seqs[0].num_prompt_tokens]
        self.completions = [Completion(i, seq, tokenizer) for i, seq in enumerate(seqs)]

    @staticmethod
    def sample_params(params: SamplingParams) -> list[SamplingParams]:
        return [params.for_sample(i) for i in range(params.n)] if params.n > 1 else [params]

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    def output(self, delta: bool = False) -> RequestOutput:
        """The request's outputs: cumulative, or only the completions with news since the last delta."""
        completions = self.completions
        if delta:
            completions = [c for c in completions
                           if c.seq.num_completion_tokens > c.reported_tokens or len(c.text) > c.reported_text]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.output(delta) for c in completions], self.finished)
