"""Triton kernels under `TRITON_INTERPRET=1` on the CPU: the interpreter is read when triton is imported, so each
kernel's cases run in a fresh interpreter (a script in this folder that prints its results as JSON on its last
line)."""
import json
import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(TESTS_DIR))


def run_interpreted(script: str, timeout: int = 300) -> dict:
    """Run `script` (in this folder) under the Triton interpreter, this repository's nanovllm first on the path (and
    the tests' shared helpers, as pytest's pythonpath has them)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
        REPO_ROOT, TESTS_DIR, os.path.dirname(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, script)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
