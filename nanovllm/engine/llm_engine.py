import os
from dataclasses import fields
from itertools import count
from time import perf_counter

from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.execution.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
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

    def _new_sequence(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        if self.model_runner is None:
            raise RuntimeError("this engine has been shut down (exit() was called); create a new LLM")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        return Sequence(next(self._seq_ids), token_ids, self.config.kvcache_block_size, params)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> int:
        """Queue one request and return its sequence id."""
        seq = self._new_sequence(self._to_token_ids(prompt, 0), sampling_params)
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Run one scheduled batch. Returns the requests that finished as (seq_id, completion token ids),
        and the number of tokens processed: positive for a prefill, negative (minus batch size) for a decode."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return [], 0
        num_tokens = sum(len(seq) - seq.num_cached_tokens for seq in seqs) if is_prefill else -len(seqs)
        token_ids = self.model_runner.run(seqs, is_prefill)
        self.scheduler.postprocess(seqs, token_ids)
        finished = [(seq.seq_id, seq.completion_token_ids) for seq in seqs if seq.is_finished]
        return finished, num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def stats(self) -> dict[str, int]:
        """Counters since the engine started: prompt tokens served from the prefix cache, preemptions, blocks."""
        bm = self.scheduler.block_manager
        return {"num_cached_tokens": self.scheduler.num_cached_tokens,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_free_blocks": bm.num_free_blocks,
                "num_blocks": len(bm.blocks)}

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[dict]:
        """Complete every prompt; returns `{"text", "token_ids"}` per prompt, in prompt order."""
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params; "
                                 "pass one SamplingParams or one per prompt")
        else:
            sampling_params = [sampling_params] * len(prompts)
        seqs = [self._new_sequence(self._to_token_ids(p, i), sp)
                for i, (p, sp) in enumerate(zip(prompts, sampling_params))]
        order = {seq.seq_id: i for i, seq in enumerate(seqs)}
        outputs: list[list[int] | None] = [None] * len(seqs)
        try:
            for seq in seqs:
                self.scheduler.add(seq)
            self._run_until_done(order, outputs, use_tqdm)
        except BaseException:
            self.scheduler.abort_all()
            raise
        return [{"text": self.tokenizer.decode(ids) if self.tokenizer else "", "token_ids": ids} for ids in outputs]

    def _run_until_done(self, order: dict[int, int], outputs: list, use_tqdm: bool) -> None:
        pbar = tqdm(total=len(order), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        with pbar:
            while not self.is_finished():
                start = perf_counter()
                finished, num_tokens = self.step()
                elapsed = perf_counter() - start
                if num_tokens > 0:
                    prefill_tps = num_tokens / elapsed
                elif num_tokens < 0:
                    decode_tps = -num_tokens / elapsed
                pbar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s", refresh=False)
                for seq_id, token_ids in finished:
                    outputs[order[seq_id]] = token_ids
                    pbar.update(1)
