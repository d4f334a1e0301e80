"""Progress lines on stderr for the slow jobs of a first run (building the CPU kernels, converting a GGUF file), so a
newcomer is never left looking at a silent terminal."""
import sys
import threading
import time
from typing import TextIO


class Progress:
    """A line as each phase starts; one every `every` seconds while a phase lasts, with how far it got when it counts
    (`advance()`); and, if the block succeeds, `"{done} in N s"`."""

    def __init__(self, done: str, every: float = 10.0, out: TextIO | None = None):
        self.done, self.out, self.start = done, out, time.monotonic()
        self.phase, self.count, self.total = "", 0, 0
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, args=(every,), name="nanovllm-progress", daemon=True)

    def __call__(self, phase: str, total: int = 0, detail: str = "") -> None:
        """Start `phase` (announced with `detail`, ticked without it) of `total` steps, counted by `advance()`."""
        if phase != self.phase:
            self.phase, self.count, self.total = phase, 0, total
            self._say(f"{phase}{detail} ...")

    def advance(self) -> None:
        self.count += 1

    def _say(self, text: str) -> None:
        print(f"nanovllm: {text}", file=self.out or sys.stderr, flush=True)

    def _tick(self, every: float) -> None:
        while not self._stop.wait(every):
            far = f" {self.count}/{self.total}" if self.total else ""
            self._say(f"... {self.phase}{far} ({time.monotonic() - self.start:.0f} s so far)")

    def __enter__(self) -> "Progress":
        self._ticker.start()
        return self

    def __exit__(self, error_type, *_) -> None:
        self._stop.set()
        self._ticker.join()
        if error_type is None:
            self._say(f"{self.done} in {time.monotonic() - self.start:.1f} s")
