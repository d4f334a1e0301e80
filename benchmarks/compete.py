"""A busy machine on demand: another program's torch matmul loop in its own session, as a desktop user's browser or a
second terminal is. The kernel's autogroup scheduling shares the CPU per session, so this competitor takes its share
whatever its niceness: an engine whose threads wait at barriers for a descheduled peer collapses under it."""
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

LOOP = "import itertools, torch; a = torch.randn(512, 512); any(a @ a is None for _ in itertools.count())"


@contextmanager
def competing_process() -> Iterator[None]:
    """Run the competitor (torch's default threads, its own session) for the duration of the block."""
    competitor = subprocess.Popen([sys.executable, "-c", LOOP], start_new_session=True)
    try:
        time.sleep(2.0)  # past its import, into the loop
        yield
    finally:
        competitor.kill()
        competitor.wait()
