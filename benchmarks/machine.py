"""What the machine does while a benchmark runs: the device a benchmark plans for, device synchronization, the matmul
rate it reaches (MFU's peak), the memory read bandwidth (batch-1 decode's limit) and the peak memory an engine
takes."""
import multiprocessing
import os
import sys
import threading
import time
from contextlib import contextmanager

import torch


def bench_device(requested: str) -> str:
    """The device `--device` names, decided before any engine exists (the workload's defaults depend on it): "auto" is
    CUDA where torch sees a GPU, else the CPU, as the engine's own "auto"; a clear exit for CUDA without a GPU."""
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        sys.exit("bench.py: error: --device cuda was requested but no CUDA device is available; use --device cpu or "
                 "auto")
    return requested if requested != "auto" else "cuda" if available else "cpu"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: str, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Best dense matmul rate (FLOP/s) of square products, for at least `seconds` after a warm-up."""
    n = 8192 if device == "cuda" else 2048
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    synchronize(device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - start))
    return best


def read_bandwidth(gib: float = 1.0, seconds: float = 1.0) -> float:
    """Best rate (bytes/s) at which torch's threads (the benchmark's `--threads`) read a float32 buffer of `gib` GiB,
    far beyond the caches, by summing it: a STREAM-like read, for at least `seconds` after a warm-up."""
    buffer = torch.ones(int(gib * 2 ** 30) // 4)
    buffer.sum()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.numel() * 4 / (time.perf_counter() - start))
    return best


def _rss_bytes() -> int:
    """Resident memory of this process and its children (data-parallel replicas, tensor-parallel workers)."""
    total = 0
    for pid in ["self", *(p.pid for p in multiprocessing.active_children())]:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # it exited meanwhile
            pass
    return total


class PeakMemory:
    """Peak memory above a baseline taken at construction, seen while `watch()` is active: allocated
    device memory on CUDA, resident host memory on CPU (sampled every 20 ms)."""

    def __init__(self, device: str):
        self.device = device
        self.base = torch.cuda.memory_allocated() if device == "cuda" else _rss_bytes()
        self.peak = self.base

    @contextmanager
    def watch(self):
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            yield
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())
            return
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                self.peak = max(self.peak, _rss_bytes())
                done.wait(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            yield
        finally:
            done.set()
            sampler.join()

    @property
    def gib(self) -> float:
        return (self.peak - self.base) / 2**30
