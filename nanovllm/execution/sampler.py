"""Sampling on rank 0: one batched pass over a step's logits, with each sequence's sampling state kept on the device.

A step's results reach the host together: the sampler, the verifier and prompt logprobs build `Pending` results
(their tensors still on the device, and what the host makes of their values), and `fetch` copies every tensor of
them to the host in one transfer (on CUDA: one wait for the GPU per step)."""
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import torch

from nanovllm.execution.logits_processors import ProcessorBatch
from nanovllm.execution.sampling_ops import (
    NEG_INF,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    apply_top_p_sorting_few,
    draw_tokens,
    greedy_tokens,
    token_logprobs,
    uniforms,
)
from nanovllm.execution.step_inputs import to_device
from nanovllm.kernels.fused import cpu_kernel
from nanovllm.outputs import TokenLogprobs
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_output.bitmask import TokenBitmask, apply_token_bitmask


@dataclass
class SamplingRow:
    """What the sampler reads of a sequence; the engine's Sequence has the same attributes and is passed as is."""

    seq_id: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int


@dataclass
class PromptRows:
    """The logits rows that score `seq`'s prompt tokens `first + 1`, `first + 2`, ... in this step."""

    seq: SamplingRow
    first: int
    rows: list[int]


@dataclass
class SamplerOutput:
    """One sampled token id per row; with `logprobs` (one entry per row, None where not asked) when any row asked;
    `prompt_logprobs`: per sequence id, the first prompt position scored in this step and its tokens' logprobs.
    With `num_accepted` (speculative decoding), sequence i has `num_accepted[i] + 1` tokens (its accepted drafts and
    the token after them), consecutive in `token_ids` and `logprobs`."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] | None = None
    num_accepted: list[int] | None = None


def num_completion_tokens(seq: SamplingRow) -> int:
    return len(seq.token_ids) - seq.num_prompt_tokens


T = TypeVar("T")


@dataclass
class Pending(Generic[T]):
    """A result whose values are still on the device: `finish` makes it from `tensors`' values (host lists, in
    order), once `fetch` has copied them."""

    tensors: list[torch.Tensor]
    finish: Callable[[list], T]


def gather(parts: Sequence[Pending | None], make: Callable[[list], T]) -> Pending[T]:
    """One pending result from `parts`: `make` gets each part's result (None for a part that is None)."""
    tensors = [t for part in parts if part is not None for t in part.tensors]

    def finish(values: list) -> T:
        results, i = [], 0
        for part in parts:
            if part is None:
                results.append(None)
                continue
            results.append(part.finish(values[i:i + len(part.tensors)]))
            i += len(part.tensors)
        return make(results)

    return Pending(tensors, finish)


def to_host(tensors: Sequence[torch.Tensor]) -> list:
    """The tensors' values as host lists, in one transfer: on CUDA each is copied without blocking (into pinned
    memory: `to("cpu", non_blocking=True)` pins its result) and the host then waits once, for all of them; on the
    CPU there is nothing to wait for."""
    if not tensors or tensors[0].device.type == "cpu":
        return [t.tolist() for t in tensors]
    copies = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [copy.tolist() for copy in copies]


def fetch(pending: Pending[T]) -> T:
    """`pending`'s result, its tensors brought to the host in one transfer."""
    return pending.finish(to_host(pending.tensors))


def fetch_step(sampled: Pending[SamplerOutput], prompt: Pending[dict] | None) -> SamplerOutput:
    """A step's output: its samples and, with `prompt` (`Sampler.score_prompts`), its prompt logprobs, in one
    transfer."""
    if prompt is None:
        return fetch(sampled)
    output, prompt_logprobs = fetch(gather([sampled, prompt], tuple))
    output.prompt_logprobs = prompt_logprobs
    return output


class DeviceTail(NamedTuple):
    """Tokens at the end of rows' `token_ids` that the host does not know yet (a draft model's drafts, drawn on the
    device): row i's last `len(index[i])` tokens are `tokens[index[i]]`; its `token_ids` hold placeholders there."""

    tokens: torch.Tensor
    index: list[list[int]]


class Sampler:
    """Samples one token per row of a step's logits `[batch, vocab]`, row i for `seqs[i]`: min_tokens, allowed
    tokens, bad words, custom logits processors, penalties, temperature, min-p, top-k, top-p, then a draw; greedy rows
    (temperature 0) take the exact argmax of the penalized logits. The order is vLLM V1's: custom processors that can
    change the argmax see the logits before penalties, argmax-invariant ones run after temperature and min-p in steps
    that sample (`logits_processors`: a `ProcessorBatch`, which the model runner sets after its warm-up). Stages no
    row uses are skipped, as decided on the host from the params; the only host sync is reading the result (`sample`
    leaves it pending, so that verification and prompt logprobs share the step's transfer).

    `logprobs_mode` (vLLM's, one of `nanovllm.config.LOGPROBS_MODES`) says what logprobs hold: log-probabilities
    ("*_logprobs") or logits ("*_logits") of the raw logits (the model's, after a structured output's grammar mask) or
    of the processed ones, those each row's token is drawn from: after min_tokens, allowed tokens, bad words, custom
    logits processors and penalties, and for rows that sample (temperature > 0) temperature, min-p, argmax-invariant
    processors, top-k and top-p, with what they drop at -inf
    (a greedy row's are its logits before the argmax). Prompt logprobs are never processed: prompt tokens are not
    sampled. The tokens drawn are the same in every mode.

    Per-sequence state, kept until `release(seq_ids)`: for penalized sequences a row of `prompt_mask` and
    `output_counts` (built from the sequence's tokens when first seen, then counted on the device after each
    sample), and for seeded ones a torch.Generator seeded with `params.seed`, so that their draws do not depend on
    the batch. Only rows whose sampled token the engine appends may be passed: a sample that is dropped (say, after
    a partial prefill) still advances the row's generator.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int], device: torch.device | str,
                 logprobs_mode: str = "raw_logprobs"):
        self.logprobs_mode = logprobs_mode
        self.processed_logprobs = logprobs_mode.startswith("processed")  # read the logits a row is sampled from
        self.normalized_logprobs = logprobs_mode.endswith("logprobs")  # log-softmax them (else the logits as they are)
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.device = torch.device(device)
        self.generators: dict[int, torch.Generator] = {}
        self.entries: dict[int, int] = {}  # seq id -> its row of the count tables
        self.counted: dict[int, int] = {}  # seq id -> how many completion tokens its output counts cover
        self.free_entries: list[int] = []
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.logits_processors: ProcessorBatch | None = None

    def release(self, seq_ids: Iterable[int]) -> None:
        """Drop the state of finished or aborted sequences."""
        seq_ids = list(seq_ids)
        if self.logits_processors is not None:
            self.logits_processors.release(seq_ids)
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
            self.counted.pop(seq_id, None)
            if seq_id in self.entries:
                self.free_entries.append(self.entries.pop(seq_id))

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def _index(self, rows: list[int], batch: int) -> torch.Tensor | slice:
        """Selects `rows` of the batch; a plain slice when that is every row, so nothing is gathered or scattered."""
        return slice(None) if len(rows) == batch else self._tensor(rows, torch.int64)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SamplingRow], allowed: TokenBitmask | None = None,
                 prompt: Pending[dict] | None = None) -> SamplerOutput:
        """`allowed`: structured outputs' grammar mask, applied first (as vLLM: logprobs see the masked logits).
        `prompt`: the step's prompt logprobs (`score_prompts`), brought to the host with the samples."""
        return fetch_step(self.sample(logits, seqs, allowed), prompt)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: Sequence[SamplingRow],
               allowed: TokenBitmask | None = None) -> Pending[SamplerOutput]:
        """`__call__`'s output, still on the device."""
        if not seqs:
            return Pending([], lambda values: SamplerOutput([]))
        processors = self.logits_processors
        if processors is not None:
            processors.update(seqs)
        logits = logits.float()
        if allowed is not None:
            logits = apply_token_bitmask(logits, allowed)
        params = [seq.params for seq in seqs]
        processed = self._restrict(self._suppress_stop_tokens(logits, seqs), seqs)
        if processors is not None and processors.non_argmax_invariant:
            processed = processors.apply(processed, processors.non_argmax_invariant, shared=processed is logits)
        penalized = [i for i, p in enumerate(params) if p.uses_penalties]
        if penalized:
            index = self._index(penalized, len(seqs))
            entries = self._entries([seqs[i] for i in penalized])
            processed = self._penalize(processed, [params[i] for i in penalized], index, entries)
        token_ids, sampled_from = self._sample(processed, seqs)
        if penalized:
            self.output_counts[entries, token_ids[index]] += 1
            for i in penalized:
                self.counted[seqs[i].seq_id] += 1
        logprobs = self.logprobs(logits, seqs, token_ids, sampled_from)
        if logprobs is None:
            return Pending([token_ids], lambda values: SamplerOutput(values[0]))
        return gather([Pending([token_ids], lambda values: values[0]), logprobs],
                      lambda results: SamplerOutput(*results))

    def logprobs(self, logits: torch.Tensor, seqs: Sequence[SamplingRow], token_ids: torch.Tensor,
                 sampled_from: torch.Tensor) -> Pending[list[TokenLogprobs | None]] | None:
        """Each row's `token_ids` logprobs (and its top ones) where its sequence asked, pending; None when none
        asked. `logits` are the raw logits, `sampled_from` the processed ones (see the class): the mode reads one."""
        asked = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not asked:
            return None
        index = self._index(asked, len(seqs))
        counts = [self._num_logprobs(seqs[i].params.logprobs) for i in asked]
        scores = sampled_from if self.processed_logprobs else logits
        results = token_logprobs(scores[index].float(), token_ids[index], max(counts), self.normalized_logprobs)

        def finish(values: list) -> list[TokenLogprobs | None]:
            chosen, ranks, top_ids, top_logprobs = values
            logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
            for j, (i, k) in enumerate(zip(asked, counts)):
                logprobs[i] = TokenLogprobs(chosen[j], ranks[j], top_ids[j][:k], top_logprobs[j][:k])
            return logprobs

        return Pending(list(results), finish)

    @torch.inference_mode()
    def masked(self, logits: torch.Tensor, seqs: Sequence[SamplingRow], tail: DeviceTail | None = None) -> torch.Tensor:
        """Float32 logits with what min_tokens, allowed_token_ids and bad words forbid at -inf (rows without
        penalties: speculative decoding's draft and verified rows). `tail`: the rows' last tokens that are known on
        the device only (bad words are matched against them there)."""
        return self._restrict(self._suppress_stop_tokens(logits.float(), seqs), seqs, tail)

    @torch.inference_mode()
    def distribution(self, masked: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution each row (temperature > 0, no penalties) samples from, given its logits `masked`: the
        softmax of `truncated`."""
        return self.truncated(masked, seqs).softmax(dim=-1)

    @torch.inference_mode()
    def truncated(self, masked: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits each row (temperature > 0, no penalties) samples from, given its logits `masked`: temperature,
        min-p, top-k and top-p as `__call__` applies them (what they drop at -inf)."""
        return self._truncated(masked, [seq.params for seq in seqs], [False] * len(seqs))

    @torch.inference_mode()
    def score_prompts(self, logits: torch.Tensor, prompt_rows: list[PromptRows]) -> Pending[dict]:
        """The log-probabilities of prompt tokens (their logits in the "*_logits" modes; never processed: prompt
        tokens are not sampled), from the logits rows `prompt_rows` name (in that order), pending: per sequence id,
        the first prompt position scored and its tokens' logprobs."""
        targets = [token_id for p in prompt_rows for token_id in p.seq.token_ids[p.first + 1:p.first + 1 + len(p.rows)]]
        counts = [self._num_logprobs(p.seq.params.prompt_logprobs) for p in prompt_rows]
        results = token_logprobs(logits.float(), self._tensor(targets, torch.int64), max(counts),
                                 self.normalized_logprobs)

        def finish(values: list) -> dict[int, tuple[int, list[TokenLogprobs]]]:
            chosen, ranks, top_ids, top_logprobs = values
            out, row = {}, 0
            for p, k in zip(prompt_rows, counts):
                out[p.seq.seq_id] = p.first, [TokenLogprobs(chosen[r], ranks[r], top_ids[r][:k], top_logprobs[r][:k])
                                              for r in range(row, row + len(p.rows))]
                row += len(p.rows)
            return out

        return Pending(list(results), finish)

    def _num_logprobs(self, asked: int) -> int:
        return self.vocab_size if asked == -1 else asked

    def _penalize(self, logits: torch.Tensor, params: list[SamplingParams], index: torch.Tensor | slice,
                  entries: torch.Tensor) -> torch.Tensor:
        penalties = [self._tensor([getattr(p, name) for p in params], torch.float32)
                     for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")]
        rows = apply_penalties(logits[index], self.prompt_mask[entries], self.output_counts[entries], *penalties)
        return rows if isinstance(index, slice) else logits.index_put((index,), rows)

    def _entries(self, seqs: list[SamplingRow]) -> torch.Tensor:
        """Each sequence's row of the count tables, (re)built from its tokens unless it counts exactly the
        completion so far (it does from the second step on, as long as every sample is appended)."""
        stale = [seq for seq in seqs if self.counted.get(seq.seq_id) != num_completion_tokens(seq)]
        if stale:
            self._build(stale)
        return self._tensor([self.entries[seq.seq_id] for seq in seqs], torch.int64)

    def _build(self, seqs: list[SamplingRow]) -> None:
        new = [seq.seq_id for seq in seqs if seq.seq_id not in self.entries]
        self._grow(len(self.entries) + len(new))
        for seq_id in new:
            self.entries[seq_id] = self.free_entries.pop()
        entries, prompt_entries, prompt_ids, output_entries, output_ids = [], [], [], [], []
        for seq in seqs:
            entry, n = self.entries[seq.seq_id], seq.num_prompt_tokens
            entries.append(entry)
            prompt_entries += [entry] * n
            prompt_ids += seq.token_ids[:n]
            output_entries += [entry] * (len(seq.token_ids) - n)
            output_ids += seq.token_ids[n:]
            self.counted[seq.seq_id] = num_completion_tokens(seq)
        entries = self._tensor(entries, torch.int64)
        self.prompt_mask[entries] = False
        self.output_counts[entries] = 0
        self.prompt_mask[self._tensor(prompt_entries, torch.int64), self._tensor(prompt_ids, torch.int64)] = True
        output_index = (self._tensor(output_entries, torch.int64), self._tensor(output_ids, torch.int64))
        self.output_counts.index_put_(output_index, torch.ones(len(output_ids), dtype=torch.int32, device=self.device),
                                      accumulate=True)

    def _grow(self, needed: int) -> None:
        """Room in the count tables for `needed` sequences (doubling, so growth is rare)."""
        capacity = self.output_counts.size(0)
        if needed <= capacity:
            return
        extra = max(needed, 2 * capacity) - capacity
        self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(extra, self.vocab_size)])
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(extra, self.vocab_size)])
        self.free_entries += range(capacity, capacity + extra)

    def _suppress_stop_tokens(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        """min_tokens: while a sequence has fewer completion tokens, EOS (unless ignored) and its stop tokens are
        never sampled."""
        rows, token_ids = [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            if num_completion_tokens(seq) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                rows += [i] * len(stops)
                token_ids += stops
        if not rows:
            return logits
        return logits.index_put((self._tensor(rows, torch.int64), self._tensor(token_ids, torch.int64)),
                                logits.new_full((), NEG_INF))

    def _restrict(self, logits: torch.Tensor, seqs: Sequence[SamplingRow],
                  tail: DeviceTail | None = None) -> torch.Tensor:
        """`allowed_token_ids`: every other token is never sampled. `bad_words`: a word's last token is never
        sampled where the completion ends with the word's other tokens (a one-token word: anywhere); the tokens of
        `tail` are compared on the device."""
        restricted = [i for i, seq in enumerate(seqs) if seq.params.allowed_token_ids]
        if restricted:
            allowed = [seqs[i].params.allowed_token_ids for i in restricted]
            bias = logits.new_full((len(restricted), logits.size(1)), NEG_INF)
            bias[self._tensor([j for j, ids in enumerate(allowed) for _ in ids], torch.int64),
                 self._tensor([t for ids in allowed for t in ids], torch.int64)] = 0
            index = self._tensor(restricted, torch.int64)
            logits = logits.index_put((index,), logits[index] + bias)
        rows, banned, unsure = [], [], []  # unsure: (row, token, [(index into tail.tokens, token it must be)])
        for i, seq in enumerate(seqs):
            if not seq.params.bad_words_token_ids:
                continue
            completion = seq.token_ids[seq.num_prompt_tokens:]
            unknown = tail.index[i] if tail is not None else []
            known = len(completion) - len(unknown)
            for *prefix, last in seq.params.bad_words_token_ids:
                on_device = min(len(prefix), len(unknown))
                head = len(prefix) - on_device  # the prefix's tokens that must end the known completion
                if len(prefix) > len(completion) or completion[known - head:known] != prefix[:head]:
                    continue
                if on_device:
                    unsure.append((i, last, list(zip(unknown[len(unknown) - on_device:], prefix[head:]))))
                else:
                    rows.append(i)
                    banned.append(last)
        if rows:
            logits = logits.index_put((self._tensor(rows, torch.int64), self._tensor(banned, torch.int64)),
                                      logits.new_full((), NEG_INF))
        if unsure:
            index = self._tensor([k for _, _, pairs in unsure for k, _ in pairs], torch.int64)
            expected = self._tensor([t for _, _, pairs in unsure for _, t in pairs], torch.int64)
            owner = self._tensor([c for c, (_, _, pairs) in enumerate(unsure) for _ in pairs], torch.int64)
            mismatches = logits.new_zeros(len(unsure)).index_add_(0, owner, (tail.tokens[index] != expected).float())
            ban = torch.where(mismatches == 0, NEG_INF, 0.0)  # added: duplicates of a (row, token) add up
            logits = logits.index_put((self._tensor([i for i, _, _ in unsure], torch.int64),
                                       self._tensor([t for _, t, _ in unsure], torch.int64)), ban, accumulate=True)
        return logits

    def _sample(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's token, and the logits it was drawn from (a greedy row's: `logits`, temperature 1, nothing
        truncated; None where the CPU kernel drew them: only the processed logprobs modes read them)."""
        params = [seq.params for seq in seqs]
        greedy = [p.temperature == 0 for p in params]
        if all(greedy):
            return greedy_tokens(logits), logits
        processors = self.logits_processors
        processing = processors if processors is not None and processors.argmax_invariant else None
        generators = {i: self._generator(seq) for i, (seq, g) in enumerate(zip(seqs, greedy))
                      if not g and seq.params.seed is not None}
        kernel = cpu_kernel("sample_tokens") if logits.device.type == "cpu" else None
        if kernel is not None and processing is None and not self.processed_logprobs:
            # one pass or a few per row (`kernels/csrc/sampling.cpp`); no one reads the truncated logits
            settings = [(p.temperature or 1.0, 0.0 if g else p.min_p,
                         p.top_k if not g and 0 < p.top_k < self.vocab_size else 0, 1.0 if g else p.top_p)
                        for p, g in zip(params, greedy)]
            temperature, min_p, top_k, top_p = zip(*settings)
            sampled = kernel(logits, self._tensor(temperature, torch.float32), self._tensor(min_p, torch.float32),
                             self._tensor(top_k, torch.int64), self._tensor(top_p, torch.float32),
                             uniforms(len(seqs), generators))
            scaled = None
        else:
            scaled = self._truncated(logits, params, greedy, processing)
            sampled = draw_tokens(scaled.softmax(dim=-1), generators)
        if not any(greedy):
            return sampled, scaled
        return torch.where(self._tensor(greedy, torch.bool), greedy_tokens(logits), sampled), scaled

    def _truncated(self, logits: torch.Tensor, params: list[SamplingParams], greedy: list[bool],
                   processors: ProcessorBatch | None = None) -> torch.Tensor:
        """Temperature, then min-p, `processors`' argmax-invariant custom logits processors (on every row, as vLLM;
        a greedy row keeps its logits), top-k and top-p, on the rows that are not `greedy` (those are divided by 1)."""
        scaled = logits / self._tensor([p.temperature or 1.0 for p in params], torch.float32).unsqueeze(1)
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        if any(min_p):
            scaled = apply_min_p(scaled, self._tensor(min_p, torch.float32))
        if processors is not None:
            scaled = processors.apply(scaled, processors.argmax_invariant, shared=False)
            if any(greedy):
                scaled = torch.where(self._tensor(greedy, torch.bool).unsqueeze(1), logits, scaled)
        top_k = [p.top_k if not g and 0 < p.top_k < self.vocab_size else 0 for p, g in zip(params, greedy)]
        if any(top_k):
            scaled = apply_top_k(scaled, self._tensor(top_k, torch.int64), max(top_k))
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        if min(top_p) < 1:
            truncated = all(k or g for k, g in zip(top_k, greedy))  # then only max(top_k) tokens per row are left
            top_p = self._tensor(top_p, torch.float32)
            if truncated or not self.reads_cost_nothing:
                scaled = apply_top_p(scaled, top_p, max(top_k) if truncated else None)
            else:
                scaled = apply_top_p_sorting_few(scaled, top_p)
        return scaled

    @property
    def reads_cost_nothing(self) -> bool:
        """Whether reading a tensor's values on the host waits for nothing (the CPU: the device is the host), so
        that the sampler may take paths that read them (`apply_top_p_sorting_few`); on CUDA each is a pipeline
        bubble."""
        return self.device.type == "cpu"

    def _generator(self, seq: SamplingRow) -> torch.Generator:
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = torch.Generator(self.device).manual_seed(seq.params.seed)
        return self.generators[seq.seq_id]
