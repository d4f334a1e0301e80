"""Triton kernels under `TRITON_INTERPRET=1` on the CPU: the interpreter is read when triton is imported, so each
kernel's cases run in a fresh interpreter (a script in this folder that prints its results as JSON on its last
line)."""
import functools
import inspect
import json
import os
import subprocess
import sys
import warnings

import numpy
import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(TESTS_DIR))


@functools.cache
def interpreter_unusable() -> str | None:
    """Why Triton's interpreter cannot run kernels here, or None. Older Triton interpreters (3.6 does) turn a loaded
    scalar into an index with `int()` of its one-element array, which NumPy 2.5 refuses: every kernel that loops to a
    loaded bound fails. The compiled kernels are what the `cuda` tests check on a GPU."""
    from triton.runtime import interpreter

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            int(numpy.ones(1))
        return None
    except TypeError:
        if "int(self.handle.data)" not in inspect.getsource(interpreter):
            return None
    import triton

    return (f"Triton {triton.__version__}'s interpreter cannot run under NumPy {numpy.__version__} (it calls int() on "
            "one-element arrays, which NumPy 2.5 refuses): upgrade triton, or use numpy<2.5")


def run_interpreted(script: str, timeout: int = 300) -> dict:
    """Run `script` (in this folder) under the Triton interpreter, this repository's nanovllm first on the path (and
    the tests' shared helpers, as pytest's pythonpath has them); skip where the interpreter cannot run here."""
    if reason := interpreter_unusable():
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
        REPO_ROOT, TESTS_DIR, os.path.dirname(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, script)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
