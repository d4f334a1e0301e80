"""CPU threads that survive a busy machine.

Each torch operator runs a parallel region on all of torch's threads and waits at its end for the slowest. When
another program takes part of the CPU, the OS deschedules one of the engine's threads for a time slice of a few
milliseconds while the others wait for it, at every one of a step's hundreds of regions: throughput collapses (to a
quarter, seen on 2 cores beside one busy program), where one thread loses only its share of the CPU.

`ThreadGovernor` watches how much of the model's wall time the process's threads were on a CPU (CPU time over wall
time times threads: 1.0 on a quiet machine, where idle workers spin, 0.5 beside a program as busy as the engine).
Below `busy_below` it runs on one thread; every `retry_s` it tries all of them again for one window, and keeps them
if they get the CPU again.
"""
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger("nanovllm")


class ThreadGovernor:
    """Chooses between all of torch's `threads` and one, window by window (`window_s` of model time). `tick` runs
    at the start of every layer too, so one long step (a large prefill: a minute on a busy machine instead of
    seconds) is cut short."""

    def __init__(self, threads: int, busy_below: float = 0.75, window_s: float = 0.5, retry_s: float = 10.0):
        self.threads = threads
        self.busy_below = busy_below
        self.window_s = window_s
        self.retry_s = retry_s
        self.reduced_at: float | None = None
        self.wall_s = self.cpu_s = 0.0
        self.last: tuple[float, float] | None = None  # (wall, cpu) at the last tick of the run under way

    @contextmanager
    def run(self) -> Iterator[None]:
        """Around one model run: only time inside runs counts (the host's own work between them is one thread)."""
        self.tick()
        try:
            yield
        finally:
            self.tick()
            self.last = None

    def tick(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        if self.last is not None:
            threads = torch.get_num_threads()
            self.wall_s += (wall - self.last[0]) * threads
            self.cpu_s += cpu - self.last[1]
            if self.wall_s >= self.window_s * threads:
                self._decide(threads, self.cpu_s / self.wall_s)
                self.wall_s = self.cpu_s = 0.0
        self.last = wall, cpu

    def _decide(self, threads: int, utilization: float) -> None:
        now = time.monotonic()
        if threads > 1 and utilization < self.busy_below:
            torch.set_num_threads(1)
            self.reduced_at = now
            logger.info("nanovllm: other programs keep the CPU busy (the engine's %d threads ran %.0f%% of the "
                        "time); running on 1 thread, retrying all every %.0f s", threads, 100 * utilization,
                        self.retry_s)
        elif threads == 1 and self.reduced_at is not None and now - self.reduced_at >= self.retry_s:
            torch.set_num_threads(self.threads)  # one window with all of them decides
            self.reduced_at = None

    def restore(self) -> None:
        torch.set_num_threads(self.threads)
