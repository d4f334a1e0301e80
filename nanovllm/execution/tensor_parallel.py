"""Tensor-parallel processes: rank 0 lives in the user's process and drives workers for ranks 1..N-1.

Each worker is a `spawn`ed process that owns a model runner for its rank (an instance of the class
rank 0 passes in, so this module never imports the runner) and loops: receive a
call from rank 0, run it, repeat. Rank 0 forwards a call with `WorkerGroup.dispatch` right
before running the same call itself, so every rank enters the model's collectives in the same
order.

Control channel: one `multiprocessing` pipe per worker, carrying a pickled
`(method, args, attention context)` of a few hundred bytes in which every tensor is replaced by
a `_TensorSlot` (shape and dtype). The tensors themselves follow through `torch.distributed`
broadcasts from rank 0, one per dtype (two per step: int64 and int32), so workers never see
`Sequence` objects: rank 0 turns the batch into tensors (including re-prefills of preempted
sequences and prefix-cache hits) and workers run exactly those tensors.

Why pipes rather than the alternatives: a `torch.distributed` broadcast as the channel would
leave idle workers blocked inside a collective between `generate` calls, where the process
group timeout eventually kills them; shared memory plus events needs a fixed-size buffer and a
second handshake so that rank 0 never overwrites a message a worker has not read yet, and
leaves a segment behind if rank 0 is killed. A pipe is ordered and buffered, needs neither,
and a worker whose rank 0 dies reads EOF and exits, so no orphan is left. Per step, building and
sending the message costs far less than the batch broadcasts, whose cost is mostly the worker
process waking up, which any channel would pay.

Failure handling: a worker that raises sends its traceback up its pipe and exits; one that is
killed just exits. Either way rank 0 raises a `WorkerFailure` naming the worker, its exit code and its traceback:
gloo fails the step's collective as soon as the connection closes, a dead worker is noticed before each dispatch,
and a watchdog thread notices one that dies or is stopped by a signal mid-step, kills the workers and, on NCCL
(whose collectives would wait for the timeout, then take the user's process down), aborts the group; the step then
fails, even where its collectives returned. A worker that is alive but stops answering (stuck) makes the collective
time out after the engine's `distributed_timeout_s`: on gloo the `WorkerFailure` names it and its state; on NCCL
torch's own watchdog ends the process (`TORCH_NCCL_ASYNC_ERROR_HANDLING`). Starting (spawn, rendezvous, model loading,
KV-cache sizing) is bounded by `worker_start_timeout_s` instead: a worker importing torch on a busy machine is slow,
not stuck. After a worker failure
the group is shut down at once (no process is left behind); after any other failure inside a
step the ranks are out of step, so the group refuses further calls; `shutdown` (from
`LLM.exit()`, the context manager, or `atexit`) always destroys the process group, joins the
workers and kills any that do not exit in time.
"""
import atexit
import os
import pickle
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.distributed.process_group import abort_tp_group, finish_start, join_tp_group, leave_tp_group
from nanovllm.distributed.supervisor import Child, is_stopped, spawn, stop
from nanovllm.kernels.attention.context import get_context as get_attention_context
from nanovllm.kernels.attention.context import reset_context, set_context

JOIN_TIMEOUT_S = 10.0
FAILURE_GRACE_S = 5.0
"""How long rank 0 waits, after a failed collective, for the worker that broke it to exit and report."""
STOPPED_GRACE_S = 3.0
"""How long a worker may stay stopped by a signal while rank 0 is in a step before the step is abandoned."""
WATCH_EVERY_S = 0.5

_COMM_ERRORS = (RuntimeError, OSError, EOFError)


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or raised; the message names it and carries its traceback."""


@dataclass(frozen=True)
class _TensorSlot:
    """Stands in for a tensor in a control message; the tensor itself arrives by broadcast."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _map_tensors(obj, fn):
    """`obj` with `fn` applied to every tensor or `_TensorSlot` inside it (through tuples, lists, dicts and
    dataclasses)."""
    if isinstance(obj, (torch.Tensor, _TensorSlot)):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(item, fn) for item in obj)
    if isinstance(obj, dict):
        return {key: _map_tensors(value, fn) for key, value in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn) for f in fields(obj) if f.init})
    return obj


def _slot(tensor: torch.Tensor) -> _TensorSlot:
    return _TensorSlot(tuple(tensor.shape), tensor.dtype)


def _broadcast(slots: list[_TensorSlot], tensors: list[torch.Tensor] | None,
               device: torch.device) -> list[torch.Tensor]:
    """Broadcast rank 0's `tensors` (None on workers) with one collective per dtype; every rank gets them all."""
    out: list[torch.Tensor | None] = [None] * len(slots)
    for dtype in dict.fromkeys(slot.dtype for slot in slots):
        indices = [i for i, slot in enumerate(slots) if slot.dtype == dtype]
        sizes = [torch.Size(slots[i].shape).numel() for i in indices]
        if tensors is not None:
            flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, 0)
        for i, part in zip(indices, flat.split(sizes)):
            out[i] = part.view(slots[i].shape)
    return out


def init_process_group(config: Config, rank: int, store: dist.Store) -> None:
    """Join the tensor-parallel group: NCCL on CUDA (one device per rank), gloo on CPU."""
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if config.device == "cuda" else "gloo"
    join_tp_group(backend, store, rank, config.tensor_parallel_size, timedelta(seconds=config.worker_start_timeout_s))


def started(config: Config) -> None:
    """This rank's engine is set up: once every rank is, collectives wait at most `distributed_timeout_s`."""
    finish_start(timedelta(seconds=config.distributed_timeout_s))


class WorkerGroup:
    """Rank 0's handle on the worker processes of ranks 1..N-1 and on the process group.

    On CPU the ranks share the machine's cores: each runs `torch.get_num_threads() // N` intra-op
    threads (rank 0's own setting is restored by `shutdown`). With more threads than cores per
    rank, OpenMP threads spinning in one rank starve the rank it waits for in a collective
    (several times slower decode steps on a 2-core machine).
    """

    def __init__(self, config: Config, runner_cls: type):
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process, so tensor parallelism "
                               "cannot create its own process group; exit() the previous engine first, or use "
                               "tensor_parallel_size=1")
        world_size = config.tensor_parallel_size
        self.timeout_s = config.distributed_timeout_s
        self.closed = False
        self.broken = False
        self.reports: dict[int, str] = {}
        self.workers: list[Child] = []
        self.frozen: dict[int, float] = {}  # rank -> seconds it had been stopped when the watchdog gave up the step
        self.gave_up = False  # the watchdog ended a step: whatever it returns is not to be used
        self.put_down: set[int] = set()  # ranks the watchdog killed while they ran, after another's failure
        self._in_step = 0
        self.saved_num_threads = torch.get_num_threads()
        threads = self.saved_num_threads if config.device == "cuda" else max(1, self.saved_num_threads // world_size)
        torch.set_num_threads(threads)
        atexit.register(self.shutdown)
        try:
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = int(os.environ.get("MASTER_PORT", 0))  # 0: the OS picks a free port
            try:
                store = dist.TCPStore(addr, port, world_size, is_master=True,
                                      timeout=timedelta(seconds=config.worker_start_timeout_s),
                                      wait_for_workers=False)
            except RuntimeError as e:
                raise RuntimeError(f"could not listen on MASTER_ADDR:MASTER_PORT = {addr}:{port} for the "
                                   f"tensor-parallel rendezvous ({e}); unset MASTER_PORT to use a free port") from e
            for rank in range(1, world_size):
                spawn(f"tensor-parallel worker rank {rank}", _worker_main, runner_cls, config, rank, addr, store.port,
                      threads, register=self.workers.append)
            threading.Thread(target=self._watch, name="nanovllm-tp-watchdog", daemon=True).start()
            init_process_group(config, 0, store)
        except BaseException:
            self.shutdown()
            raise

    def _watch(self) -> None:
        """While rank 0 is in a step (`guard`), a worker that dies, or is stopped by a signal (SIGSTOP or Ctrl-Z on it,
        a debugger, an overloaded host) for `STOPPED_GRACE_S`, would hold rank 0's collective until
        `distributed_timeout_s` (on NCCL, then end the user's process): the workers are killed instead and the group
        aborted, so the collective ends at once and `guard` fails the step, naming the rank."""
        stopped_since: dict[int, float] = {}
        while not self.closed:
            time.sleep(WATCH_EVERY_S)
            now = time.monotonic()
            for rank, worker in enumerate(self.workers, start=1):
                if self._in_step and is_stopped(worker.pid):
                    stopped_since.setdefault(rank, now)
                else:
                    stopped_since.pop(rank, None)
            frozen = {rank: now - since for rank, since in stopped_since.items() if now - since >= STOPPED_GRACE_S}
            died = self._in_step and not all(worker.alive for worker in self.workers)
            if (frozen or died) and not self.closed:
                self.frozen, self.gave_up = frozen, True
                self.put_down = {rank for rank, worker in enumerate(self.workers, start=1)
                                 if worker.alive and rank not in frozen}
                for worker in self.workers:
                    worker.process.kill()  # a stopped process dies of SIGKILL too
                abort_tp_group()
                return

    def _check_alive(self) -> None:
        if self.closed:
            raise RuntimeError("this engine has been shut down; create a new LLM")
        if self.broken:
            raise RuntimeError("the tensor-parallel ranks are out of step after an error during a step; "
                               "call exit() and create a new LLM")
        if not all(worker.alive for worker in self.workers):
            self.broken = True
            raise self._worker_failure()

    def dispatch(self, method: str, *args) -> None:
        """Make every worker run `method(*args)` under rank 0's current attention context."""
        self._check_alive()
        tensors: list[torch.Tensor] = []

        def to_slot(tensor: torch.Tensor) -> _TensorSlot:
            tensors.append(tensor)
            return _slot(tensor)

        message = pickle.dumps(_map_tensors((method, args, get_attention_context()), to_slot))
        for worker in self.workers:
            worker.conn.send_bytes(message)
        if tensors:
            _broadcast([_slot(t) for t in tensors], tensors, tensors[0].device)

    @contextmanager
    def guard(self, shutdown: bool = False):
        """Run rank 0's side of a step: any error marks the group broken, and an error caused by a failed
        worker is replaced by one naming that worker. With `shutdown`, an error also stops the workers."""
        self._in_step += 1
        try:
            yield
            if self.gave_up:  # its collectives returned (an aborted NCCL one does), with nothing a step can use
                raise RuntimeError("the step's collectives were abandoned")
        except BaseException as e:
            self.broken = True
            error = self._explain(e)
            if shutdown or isinstance(error, WorkerFailure):
                self.shutdown()
            if error is e:
                raise
            raise error from e
        finally:
            self._in_step -= 1

    def _explain(self, error: BaseException) -> BaseException:
        if self.frozen:  # reported once; later calls meet a shut-down group
            failure, self.frozen = self._frozen_failure(), {}
            return failure
        if isinstance(error, WorkerFailure) or not isinstance(error, _COMM_ERRORS) or not self.workers:
            return error
        exiting = wait([worker.process.sentinel for worker in self.workers], timeout=FAILURE_GRACE_S)
        for worker in self.workers:
            if worker.process.sentinel in exiting:
                worker.process.join()  # its sentinel closes just before it can be reaped
        if not all(worker.alive for worker in self.workers):
            return self._worker_failure()
        if "timed out" in str(error).lower() or any(is_stopped(worker.pid) for worker in self.workers):
            return self._unresponsive_failure(error)
        return error

    def _frozen_failure(self) -> "WorkerFailure":
        ranks = "; ".join(f"tensor-parallel worker rank {rank} (pid {self.workers[rank - 1].pid}) was stopped by a "
                          f"signal (SIGSTOP/SIGTSTP) for {seconds:.0f} s" for rank, seconds in self.frozen.items())
        return WorkerFailure(f"{ranks} in the middle of a step, which every rank must take together; the workers "
                             "were stopped and the step's requests aborted: create a new LLM (and leave its worker "
                             "processes running).")

    def _unresponsive_failure(self, error: BaseException) -> "WorkerFailure":
        """Every worker is alive but a collective failed: name the ones that stopped answering."""
        return WorkerFailure(f"a tensor-parallel collective failed with every worker alive ({error}); the workers "
                             f"did not answer within distributed_timeout_s={self.timeout_s:g}:\n"
                             + "\n".join(worker.describe() for worker in self.workers)
                             + "\nThe workers were stopped; create a new LLM (raise distributed_timeout_s if a step "
                             "can legitimately take longer).")

    def _worker_failure(self) -> "WorkerFailure":
        lines = []
        for rank, worker in enumerate(self.workers, start=1):
            if worker.alive or rank in self.put_down:
                continue
            try:
                if rank not in self.reports and worker.conn.poll(0):
                    self.reports[rank] = worker.conn.recv()
            except (OSError, EOFError):
                pass
            report = f":\n{self.reports[rank]}" if rank in self.reports else ""
            lines.append(worker.describe() + report)
        return WorkerFailure("\n".join(lines) + "\nThe engine cannot continue: create a new LLM.")

    def shutdown(self) -> None:
        """Stop the workers, destroy the process group; safe to call twice.

        Workers get an orderly exit message and `JOIN_TIMEOUT_S` to act on it; after a failure they
        are out of step (possibly blocked in a collective), so they are killed at once.
        """
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        leave_tp_group()
        stop(self.workers, ("exit", (), None), JOIN_TIMEOUT_S, wait=not self.broken)
        torch.set_num_threads(self.saved_num_threads)


def _worker_main(runner_cls: type, config: Config, rank: int, addr: str, port: int, num_threads: int,
                 conn: Connection) -> None:
    """Entry point of the worker process for `rank`; `runner_cls(config, rank)` builds its model runner."""
    torch.set_num_threads(num_threads)
    runner = None
    try:
        store = dist.TCPStore(addr, port, config.tensor_parallel_size, is_master=False,
                              timeout=timedelta(seconds=config.worker_start_timeout_s))
        init_process_group(config, rank, store)
        runner = runner_cls(config, rank)
        while True:
            try:
                method, args, context = conn.recv()
            except EOFError:
                break  # rank 0's process is gone
            if method == "exit":
                break
            slots: list[_TensorSlot] = []
            _map_tensors((args, context), slots.append)
            tensors = iter(_broadcast(slots, None, runner.device))
            args, context = _map_tensors((args, context), lambda _: next(tensors))  # noqa: B023 (used in this iteration)
            set_context(**{f.name: getattr(context, f.name) for f in fields(context)})
            runner.call(method, *args)
            reset_context()
    except BaseException:
        try:
            conn.send(traceback.format_exc())
        except OSError:
            pass
        sys.exit(1)
    finally:
        if runner is not None:
            runner.exit()
        leave_tp_group()
        conn.close()
