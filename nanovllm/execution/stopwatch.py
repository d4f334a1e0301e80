"""Timing a piece of a step the same way on every device, without waiting for the device."""
import time

import torch


class Stopwatch:
    """Seconds between `start()` and `stop()`: wall time on the CPU; on CUDA the time between two events on the
    stream, so starting and stopping never wait for the GPU. Read `seconds()` once the step's work is done (after the
    host has waited for its results anyway), or it waits for the stop event."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else None
        self.times = [0.0, 0.0]

    def start(self) -> "Stopwatch":
        self._mark(0)
        return self

    def stop(self) -> "Stopwatch":
        self._mark(1)
        return self

    def seconds(self) -> float:
        if self.cuda:
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1]) / 1000
        return self.times[1] - self.times[0]

    def _mark(self, i: int) -> None:
        if self.cuda:
            self.events[i].record()
        else:
            self.times[i] = time.perf_counter()
