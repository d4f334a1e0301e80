"""The progress lines of a first run's slow jobs (the kernel build, a GGUF conversion)."""
import io
import threading

import pytest

from nanovllm.progress import Progress


def test_progress_lines_name_each_phase_tick_while_one_lasts_and_end_with_the_time():
    out = io.StringIO()
    with Progress("converted", every=0.01, out=out) as progress:
        progress("reading", total=0)
        progress("slow phase", total=3)
        progress("slow phase", total=3)  # the same phase again: no new line
        progress.advance()
        progress.advance()
        while "slow phase 2/3" not in out.getvalue():  # the ticker says how far the phase got
            threading.Event().wait(0.01)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["nanovllm: reading ...", "nanovllm: slow phase ..."]
    assert lines[2].startswith("nanovllm: ... slow phase 2/3 (") and lines[2].endswith(" s so far)")
    assert lines[-1].startswith("nanovllm: converted in ") and lines[-1].endswith(" s")
    out = io.StringIO()
    with pytest.raises(ZeroDivisionError), Progress("converted", every=0.01, out=out) as progress:
        progress("failing")
        raise ZeroDivisionError
    assert out.getvalue() == "nanovllm: failing ...\n" and not progress._ticker.is_alive()
