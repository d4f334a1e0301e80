import os
from dataclasses import fields
from itertools import count
from time import perf_counter

from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.execution.model_runner import ModelRunner
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

Prompt = str | list[int]


def load_tokenizer(model: str) -> PreTrainedTokenizerBase | None:
    """The model directory's tokenizer, or None when it ships none (token-id prompts still work)."""
    if not any(os.path.isfile(os.path.join(model, name)) for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer in {model!r}: {e}") from e


class LLMEngine:
    """Continuous-batching engine: `add_request`, then `step` until `is_finished`; or just `generate`."""

    def __init__(self, model: str, **kwargs):
        known = {f.name for f in fields(Config) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; valid settings: {sorted(known - {'model'})}")
        config = Config(model, **kwargs)
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = self._eos_token_ids()
        self.model_runner = ModelRunner(config)
        self.scheduler = Scheduler(config, self.eos_token_ids)
        self._seq_ids = count()

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

    def _to_token_ids(self, prompt: Prompt, index: int) -> list[int]:
        """Tokenize and validate one prompt, so a bad one is rejected before any work starts."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text but {self.config.model!r} has no tokenizer; pass token ids")
            token_ids = self.tokenizer.encode(prompt)
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

    def _new_sequence(self, token_ids: list[int], params: SamplingParams, priority: int) -> Sequence:
        if self.model_runner is None:
            raise RuntimeError("this engine has been shut down (exit() was called); create a new LLM")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int (lower runs first), got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"got priority={priority} but the engine schedules first-come-first-served; "
                             "create it with scheduling_policy='priority'")
        return Sequence(next(self._seq_ids), token_ids, self.config.kvcache_block_size, params, priority)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, priority: int = 0) -> int:
        """Queue one request and return its id. Under `scheduling_policy="priority"` a lower
        `priority` runs first (and is preempted last)."""
        seq = self._new_sequence(self._to_token_ids(prompt, 0), sampling_params, priority)
        self.scheduler.add(seq)
        return seq.seq_id

    def abort_request(self, request_id: int) -> None:
        """Stop a request wherever it is (waiting, running or preempted) and free its blocks at once;
        it finishes with `finish_reason="abort"`. Unknown or finished requests are ignored."""
        self.scheduler.abort(request_id)

    def _step(self) -> tuple[ScheduledBatch, list[Sequence]]:
        batch = self.scheduler.schedule()
        if not batch:
            return batch, []
        token_ids = self.model_runner.run(batch)
        return batch, self.scheduler.postprocess(batch, token_ids)

    def step(self) -> list[Sequence]:
        """Run one scheduled step; returns the requests that got a new token in it (finished ones included)."""
        return self._step()[1]

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

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[dict]:
        """Complete every prompt; returns `{"text", "token_ids", "finish_reason"}` per prompt, in prompt order."""
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
        sampling_params = self._per_prompt("sampling params", sampling_params, len(prompts))
        priority = self._per_prompt("priorities", 0 if priority is None else priority, len(prompts))
        seqs = [self._new_sequence(self._to_token_ids(p, i), sp, pr)
                for i, (p, sp, pr) in enumerate(zip(prompts, sampling_params, priority))]
        try:
            for seq in seqs:
                self.scheduler.add(seq)
            self._run_until_done(len(seqs), use_tqdm)
        except BaseException:
            self.scheduler.abort_all()
            raise
        return [{"text": self.tokenizer.decode(seq.completion_token_ids) if self.tokenizer else "",
                 "token_ids": seq.completion_token_ids, "finish_reason": seq.finish_reason} for seq in seqs]

    @staticmethod
    def _per_prompt(name: str, value, num_prompts: int) -> list:
        if not isinstance(value, (list, tuple)):
            return [value] * num_prompts
        if len(value) != num_prompts:
            raise ValueError(f"got {num_prompts} prompts but {len(value)} {name}; pass one value or one per prompt")
        return list(value)

    def _run_until_done(self, num_requests: int, use_tqdm: bool) -> None:
        pbar = tqdm(total=num_requests, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        with pbar:
            while not self.is_finished():
                start = perf_counter()
                batch, sampled = self._step()
                elapsed = perf_counter() - start
                pbar.set_postfix(prefill=f"{batch.num_prefill_tokens / elapsed:.0f}tok/s",
                                 decode=f"{batch.num_decode_tokens / elapsed:.0f}tok/s", refresh=False)
                pbar.update(sum(seq.is_finished for seq in sampled))
