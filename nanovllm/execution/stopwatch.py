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


class SizeClassRatios:
    """A measured cost ratio per size class of a step's sequences (sizes within a factor of 2), the moving average of
    what was observed; `prior` for a class never observed. Each query moves a class's figure 1% back towards the
    prior, so that a class found too costly to be used (so no longer observed) is tried again after some hundred
    steps, in case the machine was busy when it was measured."""

    def __init__(self, prior: float):
        self.prior = prior
        self.ratios: dict[int, float] = {}

    def observe(self, num_seqs: int, ratio: float) -> None:
        size = num_seqs.bit_length()
        self.ratios[size] = ratio if size not in self.ratios else 0.7 * self.ratios[size] + 0.3 * ratio

    def __call__(self, num_seqs: int) -> float:
        size = num_seqs.bit_length()
        if size not in self.ratios:
            return self.prior
        self.ratios[size] = 0.99 * self.ratios[size] + 0.01 * self.prior
        return self.ratios[size]
