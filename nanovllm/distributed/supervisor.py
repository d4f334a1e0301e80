"""Child processes of the engine, started, described and stopped one way: tensor-parallel workers and data-parallel
replicas alike.

A child is a `spawn`ed process (never `fork`: CUDA and OpenMP state do not survive a fork) with a pipe to its parent,
and ignores Ctrl-C from its start: SIGINT reaches the parent, which stops its children. Stopping is orderly first (an
exit message and `timeout_s` to act on it), then a kill, so no child outlives the engine that started it.
"""
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import get_context, resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterator


@dataclass
class Child:
    """A child process and the parent's end of its pipe."""

    name: str
    process: BaseProcess
    conn: Connection

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None

    def describe(self) -> str:
        """The child and its state, e.g. "tensor-parallel worker rank 1 (pid 42) was killed by SIGKILL"."""
        code = self.process.exitcode
        if code is None:
            state = "is stopped by a signal (SIGSTOP/SIGTSTP)" if is_stopped(self.pid) else "is running"
        elif code < 0:
            state = f"was killed by {signal.Signals(-code).name}"
        else:
            state = f"exited with code {code}"
        return f"{self.name} (pid {self.pid}) {state}"


def spawn(name: str, target: Callable[..., None], *args: Any, register: Callable[[Child], None]) -> None:
    """Start `target(*args, conn)` in a new process, `conn` being the child's end of the pipe. The child goes to
    `register` (the parent's list of children) before it starts, so that a Ctrl-C raised at any point from then on
    leaves no child the parent does not stop: handed over after the start, a Ctrl-C raised in between left one
    running, and the program's exit waited for it (a worker in its rendezvous: up to its timeout)."""
    ctx = get_context("spawn")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=_child_main, name=f"nanovllm {name}", args=(target, *args, child_conn))
    register(Child(name, process, conn))
    try:
        with _ctrl_c_held():
            process.start()
    finally:
        child_conn.close()


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Ctrl-C reaches the whole foreground process group. A child must not die of it during its seconds of imports
    (the parent would wait for it, up to `worker_start_timeout_s` in a tensor-parallel rendezvous), and the parent must
    not lose it: SIGINT is blocked while a child starts. The child inherits the blocked mask through exec, so a Ctrl-C
    stays pending there until `_child_main` ignores it (which discards it); the parent's arrives when the block ends.
    (Ignoring SIGINT in the parent instead lost a Ctrl-C that came during `start()`: the program ran on.) The resource
    tracker is started first: starting it unblocks SIGINT."""
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _child_main(target: Callable[..., None], *args: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C pending since the start is dropped with it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    target(*args)


def stop(children: list[Child], exit_message: Any, timeout_s: float, wait: bool = True) -> None:
    """Send each child `exit_message`, give them `timeout_s` to exit (none with `wait=False`: children that may be
    stuck, say in a collective, are killed at once), kill the rest and close the pipes."""
    for child in children:
        try:
            child.conn.send(exit_message)
        except OSError:
            pass
    for child in children:
        if child.process.pid is not None:  # else it never started (its start failed or was interrupted)
            if wait:
                child.process.join(timeout_s)
            if child.process.exitcode is None:
                child.process.kill()
                child.process.join()
        child.conn.close()


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (SIGSTOP, SIGTSTP; Linux's /proc, else unknown: False)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
