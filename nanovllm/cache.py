"""nanovllm's cache directory, and a lock on it that dies with its holder."""
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and built kernels live: `$NANOVLLM_CACHE`, else `$XDG_CACHE_HOME/nanovllm`, else
    `~/.cache/nanovllm`."""
    if os.environ.get("NANOVLLM_CACHE"):
        return Path(os.environ["NANOVLLM_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanovllm"


@contextmanager
def exclusive(path: Path, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive lock on file `path` (created if missing) among processes, waiting up to `timeout_s`.

    An OS file lock (flock), not a lock file: the kernel releases it when its holder exits, even when killed, so
    a build interrupted by Ctrl-C never leaves the next run waiting forever. TimeoutError when another process
    keeps it longer.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has held {path} for over {timeout_s:.0f} s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
