import os
from collections.abc import Iterator
from dataclasses import fields
from itertools import count
from time import perf_counter

from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.engine.request import Completion, Request
from nanovllm.core.scheduler import ScheduledBatch, Scheduler
from nanovllm.core.sequence import Sequence
from nanovllm.execution.model_runner import ModelRunner
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

Prompt = str | list[int]
Conversation = list[dict[str, str]]
MAX_LOGPROBS = 20


def load_tokenizer(model: str) -> PreTrainedTokenizerBase | None:
    """The model directory's tokenizer, or None when it ships none (token-id prompts still work)."""
    if not any(os.path.isfile(os.path.join(model, name)) for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer in {model!r}: {e}") from e


class LLMEngine:
    """Continuous-batching engine: `generate`, `chat` or `stream`; or `add_request`, then `step` until `is_finished`."""

    def __init__(self, model: str, **kwargs):
        known = {f.name for f in fields(Config) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; valid settings: {sorted(known - {'model'})}")
        config = Config(model, **kwargs)
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = self._eos_token_ids()
        self.model_runner = ModelRunner(config, eos_token_ids=self.eos_token_ids)
        self.scheduler = Scheduler(config, self.eos_token_ids)
        self._seq_ids, self._request_ids = count(), count()
        self._requests: dict[int, Request] = {}
        self._completions: dict[int, tuple[Request, Completion]] = {}

    def _eos_token_ids(self) -> set[int]:
        eos = getattr(self.config.hf_config, "eos_token_id", None)
        ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def exit(self) -> None:
        if getattr(self, "model_runner", None) is not None:
            self.model_runner.exit()
            self.model_runner = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.exit()

    def _to_token_ids(self, prompt: Prompt, index: int, add_special_tokens: bool = True) -> list[int]:
        """Tokenize and validate one prompt, so a bad one is rejected before any work starts."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text but {self.config.model!r} has no tokenizer; pass token ids")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise ValueError(f"prompt {index} must be a string or a list of token ids (ints), got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"prompt {index} has {len(token_ids)} tokens, more than max_model_len={self.config.max_model_len}")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        return token_ids

    def _new_request(self, prompt: Prompt, params: SamplingParams, priority: int, index: int = 0,
                     add_special_tokens: bool = True) -> Request:
        """A validated request (nothing is queued yet): `params.n` sequences of the prompt."""
        if self.model_runner is None:
            raise RuntimeError("this engine has been shut down (exit() was called); create a new LLM")
        token_ids = self._to_token_ids(prompt, index, add_special_tokens)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.config.hf_config.vocab_size)
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {params.logprobs}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int (lower runs first), got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"got priority={priority} but the engine schedules first-come-first-served; "
                             "create it with scheduling_policy='priority'")
        seqs = [Sequence(next(self._seq_ids), token_ids, self.config.kvcache_block_size, sample_params, priority)
                for sample_params in Request.sample_params(params)]
        return Request(next(self._request_ids), prompt if isinstance(prompt, str) else None, seqs, self.tokenizer)

    def _new_requests(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                      priority: int | list[int] | None, add_special_tokens: bool = True) -> list[Request]:
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
        sampling_params = self._per_prompt("sampling params", sampling_params, len(prompts))
        priority = self._per_prompt("priorities", 0 if priority is None else priority, len(prompts))
        return [self._new_request(p, sp, pr, i, add_special_tokens)
                for i, (p, sp, pr) in enumerate(zip(prompts, sampling_params, priority))]

    @staticmethod
    def _per_prompt(name: str, value, num_prompts: int) -> list:
        if not isinstance(value, (list, tuple)):
            return [value] * num_prompts
        if len(value) != num_prompts:
            raise ValueError(f"got {num_prompts} prompts but {len(value)} {name}; pass one value or one per prompt")
        return list(value)

    def _add(self, request: Request) -> None:
        for completion in request.completions:
            self.scheduler.add(completion.seq)
            self._completions[completion.seq.seq_id] = request, completion
        self._requests[request.request_id] = request

    def _forget(self, request: Request) -> None:
        del self._requests[request.request_id]
        for completion in request.completions:
            del self._completions[completion.seq.seq_id]

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, priority: int = 0) -> int:
        """Queue one request and return its id. Under `scheduling_policy="priority"` a lower
        `priority` runs first (and is preempted last)."""
        request = self._new_request(prompt, sampling_params, priority)
        self._add(request)
        return request.request_id

    def abort_request(self, request_id: int) -> None:
        """Stop a request wherever its sequences are (waiting, running or preempted) and free their blocks at
        once; they finish with `finish_reason="abort"`. Unknown or finished requests are ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for completion in request.completions:
            if not completion.seq.is_finished:
                self.scheduler.finish(completion.seq, "abort")
        self._forget(request)

    def _step(self) -> tuple[ScheduledBatch, list[Request]]:
        """One step: schedule, run, append the sampled tokens, detokenize and apply stop strings. Returns the
        step's batch and the requests that got a token in it."""
        batch = self.scheduler.schedule()
        if not batch:
            return batch, []
        output = self.model_runner.run(batch)
        sampled = self.scheduler.postprocess(batch, output.token_ids)
        updated: dict[int, Request] = {}
        for seq, logprobs in zip(sampled, output.logprobs or [None] * len(sampled)):
            request, completion = self._completions[seq.seq_id]
            stop = completion.update(logprobs)
            if stop is not None and seq.is_finished:
                seq.finish_reason, seq.stop_reason = "stop", stop
            elif stop is not None:
                self.scheduler.finish(seq, "stop", stop)
            updated[request.request_id] = request
        for request in updated.values():
            if request.finished:
                self._forget(request)
        return batch, list(updated.values())

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the outputs so far of the requests that got a token in it."""
        return [request.output() for request in self._step()[1]]

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def stats(self) -> dict[str, int]:
        """Counters since the engine started: prompt tokens served from the prefix cache, steps (with a
        prompt chunk that did not finish its prompt; with decodes and prefill chunks together),
        preemptions, and KV blocks."""
        s, bm = self.scheduler, self.scheduler.block_manager
        return {"num_cached_tokens": s.num_cached_tokens,
                "num_steps": s.num_steps,
                "num_chunked_steps": s.num_chunked_steps,
                "num_mixed_steps": s.num_mixed_steps,
                "num_preemptions": s.num_preemptions,
                "num_free_blocks": bm.num_free_blocks,
                "num_blocks": len(bm.blocks)}

    def _abort_all(self) -> None:
        """After an error mid-generate: every unfinished request ends as aborted and frees its blocks."""
        self.scheduler.abort_all()
        self._requests.clear()
        self._completions.clear()

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True, priority: int | list[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); one `RequestOutput` per prompt, in prompt order.
        `sampling_params` and `priority` are one value for all prompts or one per prompt."""
        return self._generate(self._new_requests(prompts, sampling_params, priority), use_tqdm)

    def chat(self, messages: Conversation | list[Conversation], sampling_params: SamplingParams | list[SamplingParams],
             use_tqdm: bool = True, priority: int | list[int] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Reply to one conversation (a list of `{"role", "content"}` messages) or to a list of them, through the
        model's chat template, as vLLM's `LLM.chat`; one `RequestOutput` per conversation."""
        single = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], dict)
        prompts = [self._chat_text(c, add_generation_prompt) for c in ([messages] if single else messages)]
        return self._generate(self._new_requests(prompts, sampling_params, priority, add_special_tokens=False),
                              use_tqdm)

    def chat_prompt(self, conversation: Conversation, add_generation_prompt: bool = True) -> list[int]:
        """The token ids `chat` sends for `conversation`, e.g. to `stream` a reply."""
        return self.tokenizer.encode(self._chat_text(conversation, add_generation_prompt), add_special_tokens=False)

    def _chat_text(self, conversation: Conversation, add_generation_prompt: bool) -> str:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(f"{self.config.model!r} has no chat template (a base model?); use generate() with the "
                             "prompt text instead")
        if not (isinstance(conversation, (list, tuple)) and conversation and all(
                isinstance(m, dict) and {"role", "content"} <= m.keys() for m in conversation)):
            raise ValueError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} "
                             f"dicts) or a list of conversations, got {conversation!r}")
        return self.tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _generate(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        try:
            for request in requests:
                self._add(request)
            self._run_until_done(len(requests), use_tqdm)
        except BaseException:
            self._abort_all()
            raise
        return [request.output() for request in requests]

    def stream(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
               priority: int | list[int] | None = None) -> Iterator[RequestOutput]:
        """Complete every prompt, yielding each request's news as it is produced, in step order: a `RequestOutput`
        whose completions hold only the text and tokens (and logprobs) new since the last one; a completion's
        last one carries its `finish_reason`. Text never ends inside a multi-byte character, and the deltas of a
        completion add up to its `generate` text. Request ids are consecutive, in prompt order. Leaving the loop
        early aborts the requests still running."""
        requests = self._new_requests(prompts, sampling_params, priority)
        try:
            for request in requests:
                self._add(request)
            ids = {request.request_id for request in requests}
            while not all(request.finished for request in requests):
                for request in self._step()[1]:
                    if request.request_id in ids:
                        yield request.output(delta=True)
        except GeneratorExit:
            for request in requests:
                self.abort_request(request.request_id)
            raise
        except BaseException:
            self._abort_all()
            raise

    def _run_until_done(self, num_requests: int, use_tqdm: bool) -> None:
        pbar = tqdm(total=num_requests, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        with pbar:
            while not self.is_finished():
                start = perf_counter()
                batch, updated = self._step()
                elapsed = perf_counter() - start
                pbar.set_postfix(prefill=f"{batch.num_prefill_tokens / elapsed:.0f}tok/s",
                                 decode=f"{batch.num_decode_tokens / elapsed:.0f}tok/s", refresh=False)
                pbar.update(sum(request.finished for request in updated))
