"""Data parallelism: `LLM(model, data_parallel_size=N)` runs N engine replicas in worker processes behind one API.

Each replica is a whole `LLMEngine` (itself tensor-parallel with `tensor_parallel_size`) in a spawned process, on its
own devices (CUDA: replica i sees GPUs i·tp … i·tp+tp−1) or its own share of the CPU cores. The front (in the
caller's process) checks and tokenizes prompts, routes each request to a replica and gathers the outputs in prompt
order. Routing keeps the prefix cache useful: prompts whose first KV block is the same (the block's xxh64 hash, as
the block manager names it) go to the replica that got the first of them; other prompts go to the replica with the
least outstanding work (prompt plus max_tokens). A replica sends back, after each of its steps, what is new for each
of its requests.

Each request's `RequestMetrics` are the replica's (they travel in its deltas), with the front's `arrival_time` (and
`first_token_latency` from it). With `disable_log_stats=False` each replica's periodic stats lines are logged by
the front, in the caller's process, as "Engine 001: ..." (a spawned process has no logging set up).

A replica that dies: the requests it held that nobody has seen output of yet (all of `generate`'s and `chat`'s) are
retried on the other replicas, with a logged warning, so they complete exactly as they would have (greedy and seeded
sampling do not depend on the replica); a `stream` that already yielded output of one of its requests raises
`ReplicaFailure` naming the replica. The LLM goes on with the replicas left; with none, it raises `ReplicaFailure`
and is closed. A replica whose engine raised is not retried: its requests fail with its traceback.
"""
import atexit
import logging
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from copy import copy
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from nanovllm.config import Config, VllmConfig
from nanovllm.distributed.supervisor import Child, spawn, stop
from nanovllm.engine.llm_engine import (
    RELOAD_IN_FLIGHT,
    SLEEP_IN_FLIGHT,
    LLMEngine,
    check_sleep_level,
    check_sleep_mode,
    in_flight_error,
    sleeping_error,
    tags_to_wake,
    wake_tags,
)
from nanovllm.engine.pooling_prompts import CheckedPoolingPrompt
from nanovllm.engine.prompts import CheckedPrompt
from nanovllm.engine.router import PrefixRouter
from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.lora.request import LoRARequest
from nanovllm.models.reload import weight_pairs
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm.pooling_outputs import PoolingOutput, PoolingRequestOutput
from nanovllm.spec_decode.stats import combine_stats

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("nanovllm")

EXIT_TIMEOUT_S = 10.0


class ReplicaFailure(RuntimeError):
    """A data-parallel replica died (or its engine raised) and requests could not be completed elsewhere."""


@dataclass
class Routed:
    """A request as the front tracks it: where it runs, and its output so far (merged from the replica's deltas)."""

    request_id: str
    checked: CheckedPrompt
    replica: int = -1
    total: RequestOutput | None = None  # merged from the replica's deltas
    news: list[RequestOutput] = field(default_factory=list)  # deltas not yet read by a stream
    seen: bool = False  # a stream yielded some of its output
    error: BaseException | None = None
    arrival_time: float = field(default_factory=time.time)  # submitted to the front

    @property
    def finished(self) -> bool:
        return self.error is not None or self.total is not None and self.total.finished

    def output(self) -> RequestOutput:
        return self.total

    def take_news(self) -> list[RequestOutput]:
        """The deltas a stream has not read yet."""
        news, self.news = self.news, []
        self.seen |= bool(news)
        return news

    @property
    def work(self) -> int:
        return len(self.checked.token_ids) + self.checked.params.max_tokens * self.checked.params.n


def merge(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """`total` extended by `delta` (the completions' new text, tokens and logprobs, and the latest state)."""
    if total is None:
        return delta
    completions = {c.index: c for c in total.outputs}
    for new in delta.outputs:
        old = completions.get(new.index)
        completions[new.index] = new if old is None else replace(
            new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids,
            logprobs=None if old.logprobs is None else old.logprobs + (new.logprobs or []))
    return replace(delta, outputs=[completions[i] for i in sorted(completions)],
                   prompt_logprobs=delta.prompt_logprobs or total.prompt_logprobs)


@dataclass
class Replica:
    index: int
    child: Child
    alive: bool = True
    load: int = 0
    routed: int = 0
    stats: dict | None = None
    reply: object = None  # the answer to a request sent to every replica (`_ask_all`), or _PENDING


_PENDING = object()


class DataParallelLLM:
    """N `LLMEngine` replicas in worker processes behind the engine's interface (`submit`, `progress`, `turn`, `step`,
    `abort_request`, `is_finished`, `stats`, `engine_stats`, `load_weights`, `sleep`, `wake_up`, `exit`), which
    `LLM` drives (see the module docstring)."""

    def __init__(self, config: Config, data_parallel_size: int):
        """`config` as `nanovllm.engine.setup.resolve_config` made it; each replica runs an engine of it."""
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        self._lock = threading.RLock()
        self._requests: dict[str, Routed] = {}
        self._next_id = 0
        self._router = PrefixRouter(config.kvcache_block_size)
        self.replicas: list[Replica] = []
        self._asleep: set[str] = set()  # what sleeps on every replica (`sleep`, `wake_up`), and at which level
        self._sleep_level = 0
        tp = config.tensor_parallel_size
        if config.device == "cuda":
            import torch

            if data_parallel_size * tp > torch.cuda.device_count():
                raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tp} needs "
                                 f"{data_parallel_size * tp} GPUs but {torch.cuda.device_count()} are visible")
        cores = sorted(os.sched_getaffinity(0))
        per = max(len(cores) // data_parallel_size, 1)
        atexit.register(self.exit)
        try:
            for i in range(data_parallel_size):
                devices = list(range(i * tp, (i + 1) * tp)) if config.device == "cuda" else None
                share = cores[i * per:(i + 1) * per] or [cores[i % len(cores)]]
                spawn(f"data-parallel replica {i}", _replica_main, i, config, devices, share,
                      register=lambda child, i=i: self.replicas.append(Replica(i, child)))
            config.max_model_len = min(self._wait_ready(replica) for replica in self.replicas)
        except BaseException:
            self.exit()
            raise
        self.vllm_config = VllmConfig(config)  # the settings under vLLM's names, as clients read them off llm_engine
        self.model_config = self.vllm_config.model_config

    def _wait_ready(self, replica: Replica) -> int:
        child = replica.child
        if not wait([child.conn, child.process.sentinel], self.config.worker_start_timeout_s) or not child.conn.poll():
            child.process.join(1.0)
            raise ReplicaFailure(f"{child.describe()} and did not start within worker_start_timeout_s="
                                 f"{self.config.worker_start_timeout_s:g}")
        kind, payload = child.conn.recv()
        if kind != "ready":
            raise ReplicaFailure(f"data-parallel replica {replica.index} could not build its engine:\n{payload}")
        return payload

    # -- requests --

    def _route(self, routed: Routed) -> None:
        loads = {r.index: r.load for r in self.replicas if r.alive}
        if not loads:
            raise ReplicaFailure("no data-parallel replica is left; create a new LLM")
        replica = self.replicas[self._router.choose(routed.checked.token_ids, loads)]
        routed.replica = replica.index
        replica.load += routed.work
        replica.routed += 1
        # the text stays here: outputs get it back from `routed` (it would travel back with every step's delta)
        replica.child.conn.send(("add", routed.request_id, replace(routed.checked, text=None)))

    def submit(self, checked: list[CheckedPrompt]) -> list[Routed]:
        """Route each checked prompt to a replica; returns the requests, in order. Their LoRA adapters are loaded on
        every replica first (a bad one is refused here, before any request is routed)."""
        if not self.replicas:
            raise RuntimeError("this LLM has been shut down (exit() was called); create a new LLM")
        with self._lock:
            if self._asleep:
                raise sleeping_error(self._sleep_level)
            loras = {c.lora_request.lora_int_id: c.lora_request for c in checked
                     if getattr(c, "lora_request", None) is not None}
            for lora_request in loras.values():
                self.add_lora(lora_request)
            routed = []
            for c in checked:
                routed.append(Routed(str(self._next_id), c))
                self._next_id += 1
                self._requests[routed[-1].request_id] = routed[-1]
                self._route(routed[-1])
            return routed

    def turn(self) -> AbstractContextManager:
        """The front's lock (reentrant): held while reading requests' news and waiting for more."""
        return self._lock

    def progress(self, routed: list[Routed]) -> dict[str, float] | None:
        """Wait (at most a second) for the replicas' next news, unless every request of `routed` is finished (None)."""
        if all(r.finished for r in routed):
            return None
        with self._lock:
            self._pump(1.0)
        return {}

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            for routed in [self._requests[i] for i in ids if i in self._requests and not self._requests[i].finished]:
                replica = self.replicas[routed.replica]
                if replica.alive:
                    replica.child.conn.send(("abort", [routed.request_id]))
                self._finish(routed, aborted(routed))

    def _finish(self, routed: Routed, last: RequestOutput) -> None:
        routed.total = merge(routed.total, last)
        routed.news.append(last)
        self.replicas[routed.replica].load -= routed.work
        self._requests.pop(routed.request_id, None)

    def is_finished(self) -> bool:
        return not self._requests

    def get_num_unfinished_requests(self) -> int:
        """Requests submitted and not finished, on every replica (vLLM's `LLMEngine.get_num_unfinished_requests`)."""
        return len(self._requests)

    # -- receiving --

    def _pump(self, timeout: float | None = None) -> list[Routed]:
        """Wait for what replicas send (at most `timeout` seconds) and apply it; returns the requests with news."""
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise ReplicaFailure("no data-parallel replica is left; create a new LLM")
        updated: dict[str, Routed] = {}
        for ready in wait([r.child.conn for r in live] + [r.child.process.sentinel for r in live], timeout):
            replica = next(r for r in live if ready in (r.child.conn, r.child.process.sentinel))
            if not replica.alive:
                continue
            try:
                if replica.child.conn.poll():  # one message: one engine step, at most a token per request
                    self._receive(replica, replica.child.conn.recv(), updated)
            except (EOFError, OSError):
                self._lost(replica, None)
            if replica.alive and not replica.child.alive:
                self._lost(replica, None)
        return list(updated.values())

    def _receive(self, replica: Replica, message: tuple, updated: dict[str, Routed]) -> None:
        kind, payload = message
        if kind == "outputs":
            for delta in payload:
                routed = self._requests.get(delta.request_id)
                if routed is None:  # aborted meanwhile
                    continue
                delta = replace(delta, prompt=routed.checked.text) if isinstance(delta, RequestOutput) \
                    else _restored(delta)
                if getattr(delta, "metrics", None) is not None:  # a copy of its own: the front's arrival goes in
                    delta.metrics.arrival_time = routed.arrival_time
                    if delta.metrics.first_token_ts:
                        delta.metrics.first_token_latency = delta.metrics.first_token_ts - routed.arrival_time
                if delta.finished:
                    self._finish(routed, delta)
                else:
                    routed.total = merge(routed.total, delta)
                    routed.news.append(delta)
                updated[routed.request_id] = routed
        elif kind == "stats":
            replica.stats = payload
        elif kind == "reply":
            replica.reply = payload
        elif kind == "log":  # a periodic stats line of the replica's engine
            logger.log(*payload)
        elif kind == "crashed":
            self._lost(replica, payload)

    def _lost(self, replica: Replica, report: str | None) -> None:
        """`replica` is gone: retry its unfinished requests elsewhere (or fail them, see the module docstring)."""
        replica.alive = False
        replica.child.process.join(EXIT_TIMEOUT_S)
        orphans = [r for r in self._requests.values() if r.replica == replica.index and not r.finished]
        what = replica.child.describe()
        survivors = any(r.alive for r in self.replicas)
        for routed in orphans:
            if report is not None or routed.seen or not survivors:
                reason = f"its engine raised:\n{report}" if report else "no replica is left" if not survivors \
                    else "a stream had read part of its output"
                routed.error = ReplicaFailure(f"request {routed.request_id} failed: {what}; {reason}")
                self._requests.pop(routed.request_id, None)
            else:
                routed.total, routed.news = None, []
                self._route(routed)
        retried = [r.request_id for r in orphans if r.error is None]
        logger.warning("%s; %s", what, f"requests {retried} retried on the others" if retried else
                       "none of its requests could be retried")

    def step(self, delta: bool = False) -> list[RequestOutput]:
        """Wait for the replicas' next outputs; returns those of the requests that got tokens (cumulative, or with
        `delta` what is new since the last delta)."""
        with self._lock:
            if self.is_finished():
                return []
            updated = []
            while not updated:
                updated = self._pump(1.0)
            outputs = []
            for r in updated:
                outputs += r.take_news() if delta else [r.total]
            return outputs

    def stats(self) -> dict:
        """The replicas' `LLMEngine.stats()` counters summed (rates recomputed from them), and per replica its
        counters, outstanding work (prompt + max_tokens of its unfinished requests) and requests routed to it."""
        with self._lock:
            live = [r for r in self.replicas if r.alive]
            for replica in live:
                replica.stats = None
                replica.child.conn.send(("stats", None))
            while any(r.alive and r.stats is None for r in live):
                self._pump(1.0)
            per_replica = [{"replica": r.index, "alive": r.alive, "load": r.load, "num_requests": r.routed,
                            **(r.stats or {})} for r in self.replicas]
            return {**combine_stats([r for r in per_replica if r["alive"]]), "replicas": per_replica}

    def engine_stats(self) -> list[tuple[int, dict]]:
        """Each live replica's `LLMEngine.stats()`, with its index."""
        return [(r["replica"], r) for r in self.stats()["replicas"] if r["alive"]]

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Every replica's `LLMEngine.load_weights`: the weights pickled once (moved to the CPU), sent through each
        replica's pipe, and applied there; returns when every replica has them. Refused while requests are in
        flight. A replica's ValueError (every replica checks the same model the same way, so all refuse alike) is
        raised here; a replica lost meanwhile is a ReplicaFailure after the others have the weights."""
        with self._lock:
            if self._requests:
                raise in_flight_error("load_weights", len(self._requests), RELOAD_IN_FLIGHT)
            pairs = [(name, tensor.cpu()) for name, tensor in weight_pairs(weights)]
            self._tell_all("load_weights", pairs, lambda: None)

    def reset_prefix_cache(self) -> bool:
        """Every replica's `LLMEngine.reset_prefix_cache`; whether each reset all of its cache."""
        with self._lock:
            return all(reply is True for _, reply in self._ask_all(pickle.dumps(("reset_prefix_cache", None))))

    def sleep(self, level: int = 1) -> None:
        """Every replica's `LLMEngine.sleep` (see there); refused while requests are in flight."""
        check_sleep_mode(self.config, "sleep")
        check_sleep_level(level)
        with self._lock:
            if self._asleep:
                logger.warning("sleep: the engine is already sleeping (level %d); wake_up() first", self._sleep_level)
                return
            if self._requests:
                raise in_flight_error("sleep", len(self._requests), SLEEP_IN_FLIGHT)
            self._tell_all("sleep", level, lambda: self._fell_asleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Every replica's `LLMEngine.wake_up` (see there)."""
        check_sleep_mode(self.config, "wake_up")
        named, tags = tags is not None, wake_tags(tags)
        with self._lock:
            if waking := tags_to_wake(named, tags, self._asleep):
                self._tell_all("wake_up", sorted(waking), lambda: self._asleep.difference_update(waking))

    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """`LLMEngine.add_lora` on every replica (each serves every adapter); whether any read it."""
        return any(self._ask_lora("add_lora", lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        return any(self._ask_lora("remove_lora", lora_id))

    def pin_lora(self, lora_id: int) -> bool:
        return all(self._ask_lora("pin_lora", lora_id))

    def list_loras(self) -> set[int]:
        """The adapters some replica has loaded."""
        return set().union(*self._ask_lora("list_loras"))

    def _ask_lora(self, kind: str, *payload) -> list:
        """Every live replica's answer to the LoRA call `kind`; the first one's error is raised here (they refuse
        alike)."""
        with self._lock:
            replies = [reply for _, reply in self._ask_all(pickle.dumps((kind, *payload)))]
        failed = next((reply for reply in replies if isinstance(reply, BaseException)), None)
        if failed is not None:
            raise failed
        return replies

    def _fell_asleep(self, level: int) -> None:
        self._asleep, self._sleep_level = {"weights", "kv_cache"}, level

    def _tell_all(self, kind: str, payload: object, done: Callable[[], None]) -> None:
        """Every live replica runs its engine's `kind(payload)`: the first one's error is raised here (the replicas
        run the same engine on the same requests, so they fail alike); else `done()`, and a replica lost meanwhile
        is a ReplicaFailure (the others are done)."""
        replies = self._ask_all(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))
        failed = next((reply for _, reply in replies if isinstance(reply, BaseException)), None)
        if failed is not None:
            raise failed
        done()
        lost = [replica for replica, _ in replies if not replica.alive]
        if lost:
            raise ReplicaFailure(f"{kind}: " + "; ".join(r.child.describe() for r in lost) + " meanwhile; the "
                                 "replicas left go on")

    def _ask_all(self, message: bytes) -> list[tuple[Replica, object]]:
        """Send a pickled (kind, payload) message to every live replica and wait for each one's reply (or its loss:
        its reply stays _PENDING)."""
        live = [r for r in self.replicas if r.alive]
        for replica in live:
            replica.reply = _PENDING
            replica.child.conn.send_bytes(message)
        while any(r.alive and r.reply is _PENDING for r in live):
            self._pump(1.0)
        return [(replica, replica.reply) for replica in live]

    def exit(self) -> None:
        """Stop every replica (orderly, then killed after a timeout); safe to call twice."""
        atexit.unregister(self.exit)
        replicas, self.replicas = self.replicas, []
        stop([replica.child for replica in replicas], ("exit", None), EXIT_TIMEOUT_S)


def aborted(routed: Routed) -> RequestOutput | PoolingRequestOutput:
    """The last output of a request aborted before it finished, its metrics as the replica last sent them (a pooling
    request's: no data)."""
    if isinstance(routed.checked, CheckedPoolingPrompt):
        return PoolingRequestOutput(routed.request_id, PoolingOutput(None), routed.checked.token_ids, 0, True)
    n = routed.checked.params.n
    indices = range(n) if routed.total is None else [c.index for c in routed.total.outputs]
    if routed.total is not None and routed.total.metrics is not None:
        metrics = copy(routed.total.metrics)
    else:
        metrics = RequestMetrics(routed.arrival_time, num_prompt_tokens=len(routed.checked.token_ids))
    metrics.finished_time = time.time()
    return RequestOutput(routed.request_id, routed.checked.text, routed.checked.token_ids,
                         [CompletionOutput(i, "", [], finish_reason="abort") for i in indices], True,
                         num_cached_tokens=metrics.num_cached_tokens, metrics=metrics)


def _renamed(output: RequestOutput | PoolingRequestOutput, request_id: str) -> RequestOutput | PoolingRequestOutput:
    """`output` under the front's request id, ready to travel: a pooling output (made for this message alone,
    changed in place) carries its data as nested lists of floats, which the front makes a tensor again
    (`_restored`): the pipe does not take tensors (torch pickles them into shared memory)."""
    if isinstance(output, RequestOutput):
        return replace(output, request_id=request_id)
    output.request_id = request_id
    output.outputs = PoolingOutput(output.outputs.data.tolist())
    return output


def _restored(output: PoolingRequestOutput) -> PoolingRequestOutput:
    """A pooling output from a replica with its data a float32 tensor again (see `_renamed`)."""
    import torch

    output.outputs = PoolingOutput(torch.tensor(output.outputs.data, dtype=torch.float32))
    return output


def _attempt(method, *args) -> object:
    """`method(*args)`: what it returns, or the exception it raised (made picklable: its type and message, else a
    RuntimeError with its traceback) for the front to raise."""
    try:
        return method(*args)
    except Exception as e:  # noqa: BLE001 (the front raises it; the replica goes on)
        try:
            pickle.loads(pickle.dumps(e))
            return e
        except Exception:  # noqa: BLE001
            return RuntimeError(traceback.format_exc())


def _replica_main(index: int, config: Config, devices: list[int] | None, cores: list[int], conn: Connection) -> None:
    """Replica `index`: build the engine on its devices or cores, then take requests and send back each step's news
    (and its periodic stats lines, which the front logs)."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    else:
        import torch

        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    try:
        engine = LLMEngine(config)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    if engine.stat_logger is not None:
        engine.stat_logger.engine_index = index
        engine.stat_logger.emit = lambda level, line: conn.send(("log", (level, line)))
    ids: dict[str, str] = {}  # the engine's request id -> the front's
    try:
        conn.send(("ready", config.max_model_len))
        while True:
            try:
                if engine.is_finished() or conn.poll():
                    kind, *payload = conn.recv()
                    if kind == "exit":
                        return
                    if kind == "add":
                        front_id, checked = payload
                        ids[engine.submit([checked])[0].request_id] = front_id
                    elif kind == "abort":
                        mine = [own for own, front in ids.items() if front in payload[0]]
                        engine.abort_request(mine)
                        for own in mine:
                            del ids[own]
                    elif kind == "stats":
                        conn.send(("stats", engine.stats()))
                    elif kind in ("load_weights", "sleep", "wake_up"):
                        conn.send(("reply", _attempt(getattr(engine, kind), payload[0])))
                    elif kind in ("add_lora", "remove_lora", "pin_lora", "list_loras"):
                        conn.send(("reply", _attempt(getattr(engine, kind), *payload)))
                    elif kind == "reset_prefix_cache":
                        conn.send(("reply", engine.reset_prefix_cache()))
                    continue
                deltas = engine.step(delta=True)
                finished = [d.request_id for d in deltas if d.finished]
                conn.send(("outputs", [_renamed(d, ids[d.request_id]) for d in deltas]))
                for own in finished:
                    del ids[own]
            except (EOFError, OSError):
                return  # the front is gone
            except BaseException:
                conn.send(("crashed", traceback.format_exc()))
                return
    finally:
        engine.exit()
