import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import count
from typing import TYPE_CHECKING

from nanovllm.config import STEP_COST, Config, VllmConfig
from nanovllm.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from nanovllm.core.sequence import Sequence
from nanovllm.core.stopping import token_finish
from nanovllm.engine.pooling_prompts import CheckedPoolingPrompt
from nanovllm.engine.pooling_request import PoolingRequest
from nanovllm.engine.prompts import CheckedPrompt
from nanovllm.engine.request import Completion, Request
from nanovllm.engine.stats_logger import StatsLogger
from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.execution.model_runner import SLEEP_TAGS, ModelRunner
from nanovllm.lora.request import LoRARequest
from nanovllm.metrics import one_two_five_buckets
from nanovllm.outputs import RequestOutput, TokenLogprobs
from nanovllm.sampling_params import SamplingParams
from nanovllm.spec_decode.grammar_drafts import GrammarDrafts
from nanovllm.spec_decode.proposer import DraftModelProposer, NgramProposer, drafts_pay
from nanovllm.spec_decode.stats import spec_decode_stats
from nanovllm.structured_output.manager import StructuredOutputs

if TYPE_CHECKING:
    import torch

    from nanovllm.execution.pooling import PooledOutput

logger = logging.getLogger("nanovllm")


def check_sleep_mode(config: Config, method: str) -> None:
    """`sleep` and `wake_up` need `enable_sleep_mode=True` (vLLM's setting): a ValueError naming it otherwise."""
    if not config.enable_sleep_mode:
        raise ValueError(f"{method}: sleep mode is off; create the LLM with enable_sleep_mode=True to use sleep() "
                         "and wake_up()")


def check_sleep_level(level: int) -> int:
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (the KV cache freed, the weights kept: in host memory on CUDA) or 2 "
                         f"(the weights dropped too), got {level!r}")
    return level


def wake_tags(tags: Iterable[str] | None) -> set[str]:
    """vLLM's `wake_up(tags)`: None for everything, else some of "weights" and "kv_cache"; a ValueError for others."""
    if tags is None:
        return set(SLEEP_TAGS)
    if isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags):
        raise ValueError(f"wake_up tags must be a list of {list(SLEEP_TAGS)} (or None: all), got {tags!r}")
    tags = set(tags)
    if not tags or tags - set(SLEEP_TAGS):
        raise ValueError(f"wake_up tags must be some of {list(SLEEP_TAGS)} (or None: all), got {sorted(tags)}")
    return tags


def tags_to_wake(named: bool, tags: set[str], asleep: set[str]) -> set[str]:
    """Of `tags` (`named`: given by the caller, not None's all), those asleep; vLLM's warnings for the others, or when
    nothing sleeps (then nothing wakes)."""
    if not asleep:
        logger.warning("wake_up: the engine is not sleeping")
        return set()
    if named and tags - asleep:
        logger.warning("wake_up: %s already awake", " and ".join(sorted(tags - asleep)))
    return tags & asleep


def sleeping_error(level: int) -> RuntimeError:
    return RuntimeError(f"the engine is sleeping (sleep(level={level}) was called); call wake_up() first")


def in_flight_error(method: str, busy: int, why: str) -> RuntimeError:
    """`load_weights` and `sleep` wait for no request: `busy` requests are waiting or running, and `why` says what
    they would lose."""
    return RuntimeError(f"{method}: {busy} request{' is' if busy == 1 else 's are'} waiting or running; {why}: let "
                        "them finish or abort_request() them first")


RELOAD_IN_FLIGHT = ("weights can be replaced only when no request is in flight (its K/V and tokens come from the old "
                    "weights)")
SLEEP_IN_FLIGHT = "the engine sleeps only when no request is in flight (its K/V would be lost)"


class LLMEngine:
    """The continuous-batching engine in this process: `submit` checked prompts, then `step` (or `progress` for some
    requests) until they finish. `LLM` drives it (`nanovllm.llm`); `DataParallelLLM` runs one per replica.

    Safe to share between threads: every caller's requests join the same batches, and whoever's requests are
    unfinished runs the next step (one at a time, under `turn()`), so each gets exactly its own outputs, and a
    stream reads its requests' news whoever ran the step that produced it.
    """

    def __init__(self, config: Config):
        """`config` as `nanovllm.engine.setup.resolve_config` made it."""
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        self.eos_token_ids = self._eos_token_ids()
        self.model_runner = ModelRunner(config, eos_token_ids=self.eos_token_ids)
        self.scheduler = Scheduler(SchedulerConfig(
            num_kv_blocks=self.model_runner.kv_cache.num_blocks, block_size=config.kvcache_block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill, scheduling_policy=config.scheduling_policy,
            sliding_window=config.sliding_window,
            enable_prefix_caching=config.enable_prefix_caching and not self.model_runner.model.rope_needs_lengths
            and config.runner == "generate", max_loras=config.max_loras if config.enable_lora else 0))
        self.proposer = None
        if config.draft is not None:
            self.proposer = DraftModelProposer(config.speculative, config.max_model_len,
                                               self.model_runner.drafter.forward_ratio)
        elif config.speculative is not None:
            self.proposer = NgramProposer(config.speculative, config.max_model_len)
        self.grammar_drafts = GrammarDrafts(config.jump_forward, config.max_model_len)
        self.structured = StructuredOutputs(config.structured_outputs_backend, self.tokenizer,
                                            config.hf_config.vocab_size, self.eos_token_ids, config.max_num_seqs,
                                            pin_memory=config.device == "cuda")
        self._seq_ids, self._request_ids = count(), count()
        self._requests: dict[str, Request] = {}
        self._completions: dict[int, tuple[Request, Completion]] = {}
        self._pooled: dict[int, PoolingRequest] = {}  # a pooling request's sequence id -> the request
        self._unscheduled: dict[int, Request] = {}  # sequences never scheduled yet, for `RequestMetrics.scheduled_ts`
        # sequences that got their first token, their prompt tokens, of those the cached ones; tokens generated
        self.num_prompt_sequences = self.num_prompt_tokens = self.num_prompt_cached_tokens = 0
        self.num_generation_tokens = 0
        # each finished sequence's generated tokens, counted in vLLM's buckets (`vllm:request_generation_tokens`)
        self.generation_token_limits = one_two_five_buckets(config.max_model_len)
        self.num_finished_per_generation_tokens_bucket = [0] * (len(self.generation_token_limits) + 1)
        self.num_finished_generation_tokens = 0
        self.stat_logger = None if config.disable_log_stats else StatsLogger()
        self._lock = threading.RLock()
        self._waiting: set[int] = set()  # threads blocked on the lock
        self.vllm_config = VllmConfig(config)  # the settings under vLLM's names, as clients read them off llm_engine
        self.model_config = self.vllm_config.model_config

    @contextmanager
    def turn(self) -> Iterator[None]:
        """The engine's lock (reentrant), and a note that this thread waits for it (set operations are atomic under the
        GIL), so a caller looping over steps hands the lock over only when somebody waits (`_let_others_in`)."""
        me = threading.get_ident()
        self._waiting.add(me)
        try:
            with self._lock:
                self._waiting.discard(me)
                yield
        finally:
            self._waiting.discard(me)

    def _let_others_in(self) -> None:
        """Between two steps of a loop: if another thread waits for the lock, sleep for a moment so it can take it
        (released, the lock would be taken back at once). `time.sleep(0)` costs ~70 us, so only then."""
        if self._waiting:
            time.sleep(0)

    def _eos_token_ids(self) -> set[int]:
        eos = getattr(self.config.hf_config, "eos_token_id", None)
        ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def exit(self) -> None:
        with self.turn():
            if getattr(self, "model_runner", None) is not None:
                self.model_runner.exit()
                self.model_runner = None
            if getattr(self, "structured", None) is not None:
                self.structured.shutdown()

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Replace some or all of the model's weights in place, on every tensor-parallel rank, then reset the prefix
        cache (`LLM.load_weights`). Refused (a RuntimeError) while any request is waiting or running: its K/V and
        its tokens so far come from the old weights, and mixing them with the new ones would give an output neither
        model gives. Every check (names, shapes, quantized types) comes before any change: a ValueError, and the
        engine goes on with its old weights."""
        with self.turn():
            if self.model_runner is None:
                raise RuntimeError("this engine has been shut down (exit() was called); create a new LLM")
            if not self.scheduler.is_finished():
                raise in_flight_error("load_weights", len(self._requests), RELOAD_IN_FLIGHT)
            try:
                self.model_runner.load_weights(weights)
            except ValueError:
                raise  # a check failed: nothing changed, and the cached K/V are still the model's
            except BaseException:
                self.scheduler.reset_prefix_cache()  # some weights may have changed
                raise
            self.scheduler.reset_prefix_cache()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block, so no later request reuses K/V computed before (blocks that running requests
        hold keep theirs); whether none was kept, as vLLM's `reset_prefix_cache` returns."""
        with self.turn():
            return self.scheduler.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (`enable_sleep_mode=True`): give the engine's memory back until `wake_up`. The prefix
        cache is reset and the KV cache's memory freed, its K/V forgotten, at every level; level 1 keeps the weights
        (on the CPU where they are, on CUDA in host memory), level 2 drops them. Every tensor-parallel rank sleeps
        (and the draft model's KV cache; its weights are kept, in host memory on CUDA). Refused (a RuntimeError)
        while a request is waiting or running; while asleep, new requests are a RuntimeError. Already asleep: a
        warning, nothing changes (as vLLM)."""
        check_sleep_mode(self.config, "sleep")
        check_sleep_level(level)
        with self.turn():
            runner = self._runner()
            if runner.asleep:
                logger.warning("sleep: the engine is already sleeping (level %d); wake_up() first", runner.sleep_level)
                return
            if not self.scheduler.is_finished():
                raise in_flight_error("sleep", len(self._requests), SLEEP_IN_FLIGHT)
            self.scheduler.reset_prefix_cache()  # every block is free: none keeps a name, the K/V are forgotten
            runner.sleep(level)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """vLLM's `wake_up`: take back the memory of `tags` ("weights", "kv_cache"; None: both), as they were before
        `sleep` (the KV cache empty). The engine serves again once both are awake. After `sleep(level=2)` the
        weights come back zero-filled for `load_weights` to write (vLLM's way to update an RL policy:
        `wake_up(tags=["weights"])`, `load_weights(...)`, `wake_up(tags=["kv_cache"])`); when the last tag wakes
        and load_weights wrote none of them, the checkpoint is read again from the model's path, so `sleep(level=2)`
        then `wake_up()` gives back the engine that slept; when it wrote only some, a RuntimeError names the rest.
        Tags named but already awake are ignored, with a warning; not asleep at all: a warning (as vLLM)."""
        check_sleep_mode(self.config, "wake_up")
        named, tags = tags is not None, wake_tags(tags)
        with self.turn():
            runner = self._runner()
            if waking := tags_to_wake(named, tags, runner.asleep):
                runner.wake_up(waking)

    def is_sleeping(self) -> bool:
        """Whether some of the engine's memory sleeps (`sleep` was called, and `wake_up` has not woken it all)."""
        return self.model_runner is not None and bool(self.model_runner.asleep)

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("this engine has been shut down (exit() was called); create a new LLM")
        return self.model_runner

    def _new_request(self, checked: CheckedPrompt) -> Request | PoolingRequest:
        """A request for a checked prompt (nothing is queued yet): `params.n` sequences of the prompt, or for a
        pooling prompt its one sequence."""
        if self._runner().asleep:
            raise sleeping_error(self.model_runner.sleep_level)
        if isinstance(checked, CheckedPoolingPrompt):
            seq = Sequence(self.next_seq_id(), checked.token_ids, self.config.kvcache_block_size, checked.params)
            seq.pooling, seq.token_type_ids = checked.pooling, checked.token_type_ids
            return PoolingRequest(str(next(self._request_ids)), seq)
        params = checked.params
        samples = Request.sample_params(params)
        if params.bad_words:
            bad_words_token_ids = self._bad_word_ids(params)
            for sample_params in samples:
                sample_params.bad_words_token_ids = bad_words_token_ids
        seqs = [Sequence(self.next_seq_id(), checked.token_ids, self.config.kvcache_block_size, sample_params,
                         checked.priority)
                for sample_params in samples]
        if checked.lora_request is not None:
            self.add_lora(checked.lora_request)
            for seq in seqs:
                seq.lora_int_id = checked.lora_request.lora_int_id
        if checked.grammar is not None:
            for seq in seqs:
                seq.grammar = self.structured.state(checked.grammar)
        request = Request(str(next(self._request_ids)), checked.text, seqs, self.tokenizer)
        request.lora_request = checked.lora_request
        return request

    def _loras(self, method: str) -> ModelRunner:
        """The model runner, whose adapters `method` touches; a ValueError when LoRA is off."""
        if not self.config.enable_lora:
            raise ValueError(f"{method}: LoRA is off; create the LLM with enable_lora=True (and max_loras, "
                             "max_lora_rank as needed) to serve LoRA adapters")
        return self._runner()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (vLLM's `add_lora`); whether it was read (False: it was loaded already). A ValueError
        or FileNotFoundError naming the adapter when it cannot run on this model."""
        name = getattr(lora_request, "lora_name", None)
        with self.turn():
            return self._loras("lora_request" if name is None else f"lora_request for LoRA adapter {name!r}").add_lora(
                lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter (requests of it still in flight read it again); whether it was loaded."""
        with self.turn():
            return self._loras("remove_lora").remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded now."""
        with self.turn():
            return self._loras("list_loras").loras.loaded_ids()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter loaded whatever the LRU of `max_cpu_loras` says."""
        with self.turn():
            return self._loras("pin_lora").pin_lora(lora_id)

    def next_seq_id(self) -> int:
        """A sequence id no other sequence of this engine has (requests' samples, beams)."""
        return next(self._seq_ids)

    def _bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token ids, as written and after a space (as vLLM), without duplicates."""
        variants = {tuple(self.tokenizer.encode(prefix + word, add_special_tokens=False))
                    for word in params.bad_words or () for prefix in ("", " ")}
        return [list(ids) for ids in sorted(variants) if ids]

    def submit(self, checked: list[CheckedPrompt]) -> list[Request]:
        """Queue a request for each checked prompt, all or none; returns them, in order."""
        requests = [self._new_request(c) for c in checked]
        with self.turn():
            if self._runner().asleep:  # it fell asleep meanwhile
                raise sleeping_error(self.model_runner.sleep_level)
            added = []
            queued = time.time()
            try:
                for request in requests:
                    request.metrics.queued_ts = queued
                    for seq in request.seqs:
                        self.scheduler.add(seq)
                        self._unscheduled[seq.seq_id] = request
                    if isinstance(request, PoolingRequest):
                        self._pooled[request.seq.seq_id] = request
                    else:
                        for completion in request.completions:
                            self._completions[completion.seq.seq_id] = request, completion
                    self._requests[request.request_id] = request
                    added.append(request)
            except BaseException:
                for request in [*added, requests[len(added)]]:
                    self._abort(request)
                raise
        return requests

    def _count_finished(self, seq: Sequence) -> None:
        """A finished sequence's generated tokens, into the histogram `stats()` reports."""
        tokens = len(seq.token_ids) - seq.num_prompt_tokens
        self.num_finished_generation_tokens += tokens
        self.num_finished_per_generation_tokens_bucket[bisect_left(self.generation_token_limits, tokens)] += 1

    def _forget(self, request: Request) -> None:
        request.metrics.finished_time = time.time()
        self._requests.pop(request.request_id, None)
        for seq in request.seqs:
            self._completions.pop(seq.seq_id, None)
            self._unscheduled.pop(seq.seq_id, None)
            self._pooled.pop(seq.seq_id, None)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever their sequences are (waiting, running or preempted) and free their blocks at
        once; they finish with `finish_reason="abort"`. Unknown or finished requests are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self.turn():
            for request in [self._requests[i] for i in ids if i in self._requests]:
                self._abort(request)

    def _abort(self, request: Request | PoolingRequest) -> None:
        for seq in request.seqs:
            self.scheduler.abort(seq.seq_id)
        self._forget(request)

    def _price_drafts(self) -> None:
        """Drop the drafts of the step ahead where verifying them costs more than they bring (`drafts_pay`): on CUDA,
        where decode replays graphs and a step with drafts cannot (`ModelRunner.verify_cost`)."""
        running = self.scheduler.running
        price = self.model_runner.verify_cost(running)  # 1 at once on the CPU: nothing to scan there
        if price == 1 or not any(seq.spec_token_ids for seq in running):
            return
        if self.proposer is not None:
            price *= self.proposer.draft_factor
        if not drafts_pay(running, STEP_COST[self.config.device], price):
            for seq in running:
                seq.spec_token_ids = []

    def _step(self) -> tuple[ScheduledBatch, list[Request]]:
        """One step: schedule, run, append the sampled tokens, detokenize and apply stop strings. Returns the
        step's batch and the requests that got a token in it. A request whose output processing fails is aborted
        (and logged) on its own; the others go on."""
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        self.grammar_drafts.propose(self.scheduler.running, proposed=self.proposer is not None)
        self._price_drafts()
        batch = self.scheduler.schedule()
        if not batch and self.structured.wait_for_compile():  # only requests whose grammar compiles are left
            batch = self.scheduler.schedule()
        if not batch:
            return batch, []
        if self.model_runner.asleep:  # requests are refused meanwhile; beam search's sequences come this way
            raise sleeping_error(self.model_runner.sleep_level)
        if self.stat_logger is not None:
            self.stat_logger.step_started()
        if self._unscheduled:
            self._stamp_scheduled(batch.seqs)
        allowed = self.structured.bitmask([(seq, drafts) for seq, drafts, samples
                                           in zip(batch.seqs, batch.drafts, batch.samples) if samples])
        output = self.model_runner.run(batch, allowed)
        if self.config.runner == "pooling":
            done = self._pooling_done(batch, output)
            if self.stat_logger is not None:
                self.stat_logger.step_ended(self.stats, self.scheduler.is_finished())
            return batch, done
        for seq_id, (first, logprobs) in (output.prompt_logprobs or {}).items():
            self._completions[seq_id][0].add_prompt_logprobs(first, logprobs)
        sampled = self.scheduler.new_tokens(batch, output.token_ids, output.num_accepted)
        updated: dict[str, Request] = {}
        ended: list[Request] = []
        now = time.time()
        generated = 0
        all_logprobs = iter(output.logprobs or [None] * len(output.token_ids))
        for seq, token_ids in sampled:
            if seq.search is not None:  # a beam: its search takes the token (nanovllm.engine.beam_search)
                seq.search.take(seq, token_ids[0], next(all_logprobs))
                continue
            request, completion = self._completions[seq.seq_id]
            updated[request.request_id] = request
            logprobs = [next(all_logprobs) for _ in token_ids]
            before = len(seq.token_ids)
            try:
                for token_id, token_logprobs in zip(token_ids, logprobs):
                    seq.append_token(token_id)
                    if seq.grammar is not None:
                        seq.grammar.accept(token_id)
                    self._advance(seq, completion, token_logprobs)
                    if seq.is_finished:
                        break
                if output.num_accepted is not None and not seq.is_finished:
                    self.scheduler.settle(seq)
            except Exception:
                logger.exception("request %s: processing its output failed; it is aborted, the others go on",
                                 request.request_id)
                self.scheduler.abort(seq.seq_id)
            generated += len(seq.token_ids) - before
            if before == seq.num_prompt_tokens < len(seq.token_ids):  # its first token
                self.num_prompt_sequences += 1
                self.num_prompt_tokens += before
                self.num_prompt_cached_tokens += max(seq.num_cached_tokens, 0)
            if seq.is_finished:
                ended.append(request)
                self._count_finished(seq)
        self.num_generation_tokens += generated
        for request in updated.values():
            request.record_token(now)
        for request in ended:
            if request.finished:
                self._forget(request)
        if self.stat_logger is not None:
            self.stat_logger.step_ended(self.stats, self.scheduler.is_finished())
        return batch, list(updated.values())

    def _pooling_done(self, batch: ScheduledBatch, output: "PooledOutput") -> list[PoolingRequest]:
        """After a pooling step: the requests whose prompt it completed take their pooled output and end, their KV
        blocks freed at once (`Scheduler.finish_prompts`); returns them."""
        done = []
        for seq in self.scheduler.finish_prompts(batch):
            request = self._pooled[seq.seq_id]
            request.data = output.data[seq.seq_id]
            self.num_prompt_sequences += 1
            self.num_prompt_tokens += len(seq)
            self._forget(request)
            done.append(request)
        return done

    def _stamp_scheduled(self, seqs: list[Sequence]) -> None:
        """`RequestMetrics.scheduled_ts` of the requests of `seqs` that had none of their sequences scheduled yet."""
        now = time.time()
        for seq in seqs:
            request = self._unscheduled.pop(seq.seq_id, None)
            if request is not None and not request.metrics.scheduled_ts:
                request.metrics.scheduled_ts = now

    def _advance(self, seq: Sequence, completion: Completion, logprobs: TokenLogprobs | None) -> None:
        """Take the token `seq` just got and decide whether it ends there: the one place that decides (EOS, stop
        tokens, max_tokens and max_model_len by `token_finish`, a completed structured-output grammar, then stop
        strings in the detokenized text; aborts come from `abort_request` and failed steps)."""
        ending = token_finish(seq, self.eos_token_ids, self.config.max_model_len)
        grammar_end = ending is None and seq.grammar is not None and seq.grammar.is_stopped
        if grammar_end:
            ending = "stop", None
        stop_string = completion.update(logprobs, ending, token_is_text=grammar_end)
        if stop_string is not None:
            ending = "stop", stop_string
        if ending is not None:
            self.scheduler.finish(seq, *ending)

    def _step_for(self, requests: list[Request]) -> ScheduledBatch | None:
        """Under the lock, run one step if any of `requests` is unfinished (None when all are). A step that fails
        aborts every request (their state is no longer consistent), each marked with the error."""
        with self.turn():
            if all(request.finished for request in requests):
                return None
            try:
                batch, _ = self._step()
            except BaseException as e:
                self._abort_all(e)
                raise
            if not batch:
                raise RuntimeError("the scheduler has nothing to run but requests are unfinished; this is a bug")
            return batch

    def progress(self, requests: list[Request]) -> dict[str, float] | None:
        """One step if any of `requests` is unfinished (None when all are), then a moment for a caller waiting for
        the lock: the step's prefill and decode rates (tokens/s)."""
        start = time.perf_counter()
        batch = self._step_for(requests)
        if batch is None:
            return None
        elapsed = time.perf_counter() - start
        self._let_others_in()
        return {"prefill": batch.num_prefill_tokens / elapsed, "decode": batch.num_decode_tokens / elapsed}

    def step(self, delta: bool = False) -> list[RequestOutput]:
        """Run one scheduled step; returns the outputs of the requests that got a token in it: everything so far,
        or with `delta` only what is new since their last delta (as `stream` yields it)."""
        with self.turn():
            return [request.output(delta) for request in self._step()[1]]

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def get_num_unfinished_requests(self) -> int:
        """Requests submitted and not finished (vLLM's `LLMEngine.get_num_unfinished_requests`)."""
        return len(self._requests)

    def stats(self) -> dict[str, int | float]:
        """Counters since the engine started: prompt tokens served from the prefix cache, steps (with a
        prompt chunk that did not finish its prompt; with decodes and prefill chunks together),
        preemptions, KV blocks (released outside a sliding window; the most in use at once), the sequences that got
        their first token (each of `n` samples counts), their prompt tokens and of those the ones the prefix cache
        served when each was first scheduled, the tokens generated, the sequences running and waiting now, and with
        speculative decoding or jump-forward `spec_decode_stats`."""
        s, bm = self.scheduler, self.scheduler.block_manager
        stats = {"num_cached_tokens": s.num_cached_tokens,
                 "num_steps": s.num_steps,
                 "num_chunked_steps": s.num_chunked_steps,
                 "num_mixed_steps": s.num_mixed_steps,
                 "num_preemptions": s.num_preemptions,
                 "num_free_blocks": bm.num_free_blocks,
                 "num_blocks": len(bm.blocks),
                 "num_released_blocks": bm.num_released_blocks,
                 "peak_used_blocks": bm.peak_used_blocks,
                 "num_prompt_sequences": self.num_prompt_sequences,
                 "num_prompt_tokens": self.num_prompt_tokens,
                 "num_prompt_cached_tokens": self.num_prompt_cached_tokens,
                 "num_generation_tokens": self.num_generation_tokens,
                 "num_finished_generation_tokens": self.num_finished_generation_tokens,
                 "num_finished_per_generation_tokens_bucket": list(self.num_finished_per_generation_tokens_bucket),
                 "num_requests_running": len(s.running),
                 "num_requests_waiting": len(s.waiting)}
        if self.proposer is not None or self.config.jump_forward:
            k = self.config.speculative.num_speculative_tokens if self.config.speculative is not None else 0
            per_position = s.num_accepted_per_position + [0] * (k - len(s.num_accepted_per_position))
            stats.update(spec_decode_stats(s.num_draft_tokens, s.num_accepted_tokens, s.num_spec_rows, per_position))
        return stats

    def engine_stats(self) -> list[tuple[int, dict]]:
        """`stats()` of each engine (here one, index 0), as data-parallel replicas report theirs."""
        return [(0, self.stats())]

    def _abort_all(self, error: BaseException) -> None:
        """After a step failed: every unfinished request ends as aborted, frees its blocks and carries the error."""
        for request in self._requests.values():
            request.error = RuntimeError(f"request {request.request_id} was aborted because a step failed while "
                                         f"another caller ran it: {error!r}")
            request.error.__cause__ = error
        self.scheduler.abort_all()
        for request in list(self._requests.values()):
            self._forget(request)
