"""The child processes' start (`nanovllm.distributed.supervisor.spawn`) and Ctrl-C: one that comes while a child
starts reaches the parent once the child is up and in the parent's list of children, and never kills the child."""
import os
import signal
import threading
import time
from multiprocessing.context import SpawnProcess

import pytest

from nanovllm.distributed.supervisor import spawn, stop


def nap(conn) -> None:
    """A child that runs two seconds past its start (its parent's end of the pipe is gone with the interrupt)."""
    time.sleep(2.0)


def test_ctrl_c_during_a_child_s_start_reaches_the_parent_and_spares_the_child(monkeypatch):
    """SIGINT to parent and child while `start()` runs (a terminal's Ctrl-C hits the whole process group): it used to
    be ignored in the parent, so the program ran on as if no Ctrl-C had come."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("needs Python's own Ctrl-C handler")
    start, started = SpawnProcess.start, []

    def start_then_ctrl_c(process) -> None:
        start(process)
        started.append(process)
        os.kill(process.pid, signal.SIGINT)
        # to this (the main) thread: sent to the process, it may go to another of pytest's threads (Ray's, torch's),
        # whose handler trips Python's flag whenever that thread runs, after the test as well
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    monkeypatch.setattr(SpawnProcess, "start", start_then_ctrl_c)
    registered = []
    with pytest.raises(KeyboardInterrupt):
        spawn("test child", nap, register=registered.append)
    (child,) = started
    # the parent knows its child, so that stopping its children stops it: a child registered after its start, with a
    # Ctrl-C raised in between, was left running, and the program's exit waited for it (a worker in its rendezvous)
    assert [c.process for c in registered] == [child]
    child.join(timeout=60)
    assert child.exitcode == 0, f"the child ended with {child.exitcode} (-2: killed by the Ctrl-C)"


def test_a_child_whose_start_failed_is_registered_and_stopped_without_error(monkeypatch):
    def fail(process) -> None:
        raise OSError("no more processes")

    monkeypatch.setattr(SpawnProcess, "start", fail)
    registered = []
    with pytest.raises(OSError, match="no more processes"):
        spawn("test child", nap, register=registered.append)
    (child,) = registered
    assert child.pid is None
    stop(registered, ("exit",), timeout_s=1.0)  # nothing to join or kill; its pipe closed
    assert child.conn.closed
