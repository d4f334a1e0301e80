"""Beam search as vLLM's `LLM.beam_search` defines it (`nanovllm.beam_search`), run in the engine's own steps.

vLLM runs each step of a search as a batch of one-token requests, one per beam, whose prompt is the beam's tokens,
and relies on its prefix cache: a beam's full KV blocks are found again, its last, partial block is computed again
(up to block size - 1 tokens more per beam and step). Here the beams are the engine's sequences and stay in the
scheduler from step to step, so a step decodes one token per beam, batched with every other prompt's beams and any
other request: after a beam's row samples, the engine hands the token and its logprobs to the search
(`Sequence.search`) instead of appending it; once every live beam of a prompt has sampled, the search picks the next
beams, and a beam extended by several tokens forks (`Scheduler.fork`): the new sequence shares its parent's full
blocks (ref counts) and gets a copy of the partial last block's K/V (`copy_kv_blocks`, on the cache tensor before the
next step), so nothing is computed twice. The prompt is prefilled once. Measured on SmolLM2-135M (2 CPU cores, 32
prompts, width 4, 64 tokens): 4.5-5.5 s with copies, 8.2-9.2 s recomputing each fork's partial block instead, 23-30 s
as one-token requests (vLLM's way) on this engine. Where no copy can be made (tensor parallelism,
whose ranks each hold a slice of the cache; no free block; `max_num_seqs` reached), the fork waits instead and is
computed when admitted, its full blocks served by the prefix cache, as vLLM does. `search_by_requests` is vLLM's way
(one-token requests), for engines whose steps run elsewhere (data-parallel replicas).
"""
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, get_beam_search_score
from nanovllm.core.sequence import Sequence
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.prompts import CheckedPrompt
from nanovllm.execution.kv_cache import copy_kv_blocks
from nanovllm.outputs import Logprob, RequestOutput, TokenLogprobs


class Step:
    """What one step gave a beam: the tokens to extend it with, in vLLM's order (the sampled token, then the most
    likely ones by rank), as (token id, logprob, rank). Beams extended from the same beam share it."""

    __slots__ = ("candidates", "_logprobs")

    def __init__(self, candidates: list[tuple[int, float, int]]):
        self.candidates = candidates
        self._logprobs: dict[int, Logprob] | None = None

    @classmethod
    def sampled(cls, token_id: int, logprobs: TokenLogprobs) -> "Step":
        """From a sampled token and its logprobs, as the sampler gives them."""
        candidates, seen = [(token_id, logprobs.logprob, logprobs.rank)], {token_id}
        for rank, (top_id, top_logprob) in enumerate(zip(logprobs.top_ids, logprobs.top_logprobs), start=1):
            if top_id not in seen:
                seen.add(top_id)
                candidates.append((top_id, top_logprob, rank))
        return cls(candidates)

    @classmethod
    def ranked(cls, logprobs: dict[int, Logprob]) -> "Step":
        """From a completion's logprobs of one token (`CompletionOutput.logprobs[0]`)."""
        return cls([(token_id, lp.logprob, lp.rank) for token_id, lp in logprobs.items()])

    def logprobs(self, decode: Callable[[int], str | None]) -> dict[int, Logprob]:
        """As vLLM's outputs have them: token id -> Logprob (one dict, shared by the beams that share the step)."""
        if self._logprobs is None:
            self._logprobs = {t: Logprob(logprob, rank, decode(t)) for t, logprob, rank in self.candidates}
        return self._logprobs


@dataclass
class Beam:
    """A beam: its tokens (prompt included), cumulative logprob, the steps that made it, and, run by the engine, its
    sequence; once ended, why."""

    tokens: list[int]
    cum_logprob: float = 0.0
    steps: list[Step] = field(default_factory=list)
    seq: Sequence | None = None
    finish_reason: str | None = None


class PromptSearch:
    """One prompt's search, vLLM's `BeamSearchInstance`: the live beams (best first) and the ended ones."""

    def __init__(self, prompt: CheckedPrompt, params: BeamSearchParams, eos_token_id: int | None,
                 max_model_len: int):
        self.prompt = prompt
        self.params = params
        self.eos = eos_token_id
        self.max_model_len = max_model_len
        self.beams = [Beam(list(prompt.token_ids))]
        self.completed: list[Beam] = []
        self.num_steps = 0
        self.samples: dict[int, Step] = {}  # run by the engine: the step of each beam (by sequence id) that sampled

    @property
    def done(self) -> bool:
        return not self.beams

    def extend(self, steps: list[Step]) -> list[tuple[Beam, Beam]]:
        """One step of the search, given each live beam's `Step`: every beam extended by every candidate; those
        ending with EOS (unless `ignore_eos`) are set aside, the `beam_width` best others by score (a stable sort, as
        vLLM's) are the new live beams, returned with their parents. After `max_tokens` steps, or at
        `max_model_len`, they end too and none is returned."""
        params, eos = self.params, self.eos
        extended = []
        for beam, step in zip(self.beams, steps):
            for token_id, logprob, _ in step.candidates:
                cum_logprob = beam.cum_logprob + logprob
                if token_id == eos and not params.ignore_eos:
                    self.completed.append(Beam(beam.tokens + [token_id], cum_logprob, beam.steps + [step],
                                               finish_reason="stop"))
                else:
                    extended.append((beam, token_id, cum_logprob, step))
        length = len(self.beams[0].tokens) + 1
        extended.sort(key=lambda e: e[2] / ((length - (e[1] == eos)) ** params.length_penalty), reverse=True)
        chosen = [(parent, Beam(parent.tokens + [token_id], cum_logprob, parent.steps + [step]))
                  for parent, token_id, cum_logprob, step in extended[:params.beam_width]]
        self.num_steps += 1
        if self.num_steps == params.max_tokens or length >= self.max_model_len:
            for _, beam in chosen:
                beam.finish_reason = "length"
            self.completed += [beam for _, beam in chosen]
            chosen = []
        self.beams = [beam for _, beam in chosen]
        return chosen

    def output(self, tokenizer: PreTrainedTokenizerBase | None, decode: Callable[[int], str | None]) \
            -> BeamSearchOutput:
        """The `beam_width` best ended beams, best first (`get_beam_search_score`)."""
        params = self.params
        best = sorted(self.completed + self.beams, reverse=True,
                      key=lambda b: get_beam_search_score(b.tokens, b.cum_logprob, self.eos, params.length_penalty))
        return BeamSearchOutput([BeamSearchSequence(
            tokens=beam.tokens, logprobs=[step.logprobs(decode) for step in beam.steps], cum_logprob=beam.cum_logprob,
            text=tokenizer.decode(beam.tokens) if tokenizer is not None else None, finish_reason=beam.finish_reason,
            stop_reason=self.eos if beam.finish_reason == "stop" else None, lora_request=self.prompt.lora_request)
            for beam in best[:params.beam_width]])


def token_decoder(tokenizer: PreTrainedTokenizerBase | None) -> Callable[[int], str | None]:
    """One token's text, as `generate`'s logprobs have it (memoized for one call's outputs)."""
    texts: dict[int, str] = {}

    def decode(token_id: int) -> str | None:
        if tokenizer is None:
            return None
        if token_id not in texts:
            texts[token_id] = tokenizer.decode([token_id])
        return texts[token_id]

    return decode


class EngineBeamSearch:
    """`LLM.beam_search` run by an `LLMEngine` (see the module's docstring). At most `concurrency_limit` prompts are
    searched at once (None: all); another starts as one ends. The steps run under the engine's lock like any
    caller's, so other callers' requests share them, and any caller's step advances the search."""

    def __init__(self, engine: LLMEngine, prompts: list[CheckedPrompt], params: BeamSearchParams,
                 eos_token_id: int | None, concurrency_limit: int | None = None):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.copies = engine.config.tensor_parallel_size == 1  # a copy would have to run on every rank
        self.searches = [PromptSearch(p, params, eos_token_id, engine.config.max_model_len) for p in prompts]
        self.limit = len(prompts) if concurrency_limit is None else concurrency_limit
        self.pending = deque(self.searches)
        self.of_seq: dict[int, PromptSearch] = {}
        self.active: list[PromptSearch] = []

    @property
    def finished(self) -> bool:
        """Every search ended, or one was aborted (a step failed): what `LLMEngine.progress` asks of a handle."""
        return not self.pending and not self.active or self.aborted

    @property
    def aborted(self) -> bool:
        return any(beam.seq.is_finished for search in self.active for beam in search.beams)

    @property
    def num_done(self) -> int:
        return sum(search.done for search in self.searches)

    def run(self, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Search every prompt; one `BeamSearchOutput` each, in order. Every block is free again on return."""
        engine = self.engine
        with engine.turn():
            for search in self.searches:  # nothing starts unless every prompt fits and its adapter loads
                self.scheduler.check(Sequence(-1, search.prompt.token_ids, engine.config.kvcache_block_size,
                                              search.prompt.params))
                if search.prompt.lora_request is not None:
                    engine.add_lora(search.prompt.lora_request)
            self._start()
        try:
            with tqdm(total=len(self.searches), desc="Beam search", dynamic_ncols=True, disable=not use_tqdm) as bar:
                while engine.progress([self]) is not None:
                    bar.update(self.num_done - bar.n)
                if self.aborted:
                    raise RuntimeError("beam search was aborted: a step failed while another caller ran it")
        except BaseException:
            with engine.turn():
                self._abort()
            raise
        decode = token_decoder(engine.tokenizer)
        return [search.output(engine.tokenizer, decode) for search in self.searches]

    def _start(self) -> None:
        """Start pending prompts while fewer than `limit` run: each one sequence, its prompt."""
        while self.pending and len(self.active) < self.limit:
            search = self.pending.popleft()
            prompt = search.prompt
            seq = Sequence(self.engine.next_seq_id(), prompt.token_ids, self.engine.config.kvcache_block_size,
                           prompt.params)
            seq.search = self
            seq.lora_int_id = prompt.lora_request.lora_int_id if prompt.lora_request is not None else 0
            search.beams[0].seq = seq
            self.of_seq[seq.seq_id] = search
            self.scheduler.add(seq)
            self.active.append(search)

    def take(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs) -> None:
        """The engine's call for a beam whose row sampled (under its lock, within its step): the beam waits (`held`)
        until every live beam of its prompt has sampled, then the search takes one step."""
        search = self.of_seq[seq.seq_id]
        search.samples[seq.seq_id] = Step.sampled(token_id, logprobs)
        seq.held = True
        if len(search.samples) == len(search.beams):
            self._advance(search)

    def _advance(self, search: PromptSearch) -> None:
        """One step of `search`, carried out on the sequences: a parent with no child ends, one whose first child
        continues it, the other children fork from it (before it grows), and their block copies run."""
        parents = search.beams
        steps = [search.samples[beam.seq.seq_id] for beam in parents]
        search.samples.clear()
        chosen = search.extend(steps)
        continued = {}
        for parent, child in chosen:
            continued.setdefault(id(parent), child)
        for parent in parents:
            if id(parent) not in continued:
                self._drop(parent.seq)
        copies = []
        for parent, child in chosen:
            if continued[id(parent)] is child:
                child.seq = parent.seq
            else:
                child.seq, child_copies = self.scheduler.fork(parent.seq, self.engine.next_seq_id(), self.copies)
                copies += child_copies
                self.of_seq[child.seq.seq_id] = search
        for _, child in chosen:
            child.seq.append_token(child.tokens[-1])
            child.seq.held = False
        if copies:  # a draft model's cache needs none: beams never speculate, and it computes others' prompts whole
            copy_kv_blocks(self.engine.model_runner.kv_cache, copies)
        if search.done:
            self.active.remove(search)
            self._start()

    def _drop(self, seq: Sequence) -> None:
        del self.of_seq[seq.seq_id]
        self.scheduler.finish(seq, "stop")

    def _abort(self) -> None:
        """After an error: end every beam still running, freeing its blocks, and start nothing more."""
        self.pending.clear()
        for seq_id in list(self.of_seq):
            self.scheduler.abort(seq_id)
        self.of_seq.clear()


def search_by_requests(generate: Callable[[list[list[int]]], list[RequestOutput]], searches: list[PromptSearch],
                       concurrency_limit: int | None = None, use_tqdm: bool = False) -> None:
    """vLLM's way: each step, one request per live beam of up to `concurrency_limit` prompts at a time (all at once
    with None), its prompt the beam's tokens: `generate` completes them, one token each with the logprobs of the
    `2 * beam_width` most likely (the sampling params `LLM.beam_search` makes)."""
    limit = concurrency_limit or len(searches)
    with tqdm(total=len(searches), desc="Beam search", dynamic_ncols=True, disable=not use_tqdm) as bar:
        for start in range(0, len(searches), limit):
            batch = searches[start:start + limit]
            while beams := [(search, beam) for search in batch for beam in search.beams]:
                outputs = generate([beam.tokens for _, beam in beams])
                steps: dict[int, list[Step]] = {}
                for (search, _), output in zip(beams, outputs):
                    steps.setdefault(id(search), []).append(Step.ranked(output.outputs[0].logprobs[0]))
                for search in batch:
                    if not search.done:
                        search.extend(steps[id(search)])
                bar.update(sum(search.done for search in searches) - bar.n)
