"""`.ci/gpu` on a GPU machine runs to the end whatever fails: every benchmark, then the CUDA tests and the CPU tests
beside them, then the tests' failures again, and a non-zero exit status. Checked here with a stand-in `python` that
plays a GPU machine without pytest-xdist whose CUDA tests fail."""
import os
import shutil
import stat
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$1 $2" in
  "-m pytest") if [ "$6" = cuda ]; then echo "tests/x.py F"; echo "=== short test summary info ==="
                 echo "FAILED tests/x.py::test_y"; echo "1 failed, 9 passed"; exit 1; fi
               echo "cpu: 30 passed" ;;
  "-c import xdist") exit 1 ;;
  "bench.py --attention-backend") echo "bench: 123 tok/s" ;;
  "bench.py --attention-micro") echo "micro: 45 us" ;;
  "- ") cat > /dev/null; echo "GPU: a stand-in" ;;
esac
"""


def test_a_failing_suite_still_ends_with_the_figures_and_the_failures(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls)}
    checkout = tmp_path / "checkout"  # a bare copy: no wheels carried in .gpu-carry/ to install first
    (checkout / ".ci").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, ".ci", "gpu"), checkout / ".ci" / "gpu")
    result = subprocess.run(["bash", ".ci/gpu"], cwd=checkout, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    calls = calls.read_text().splitlines()
    assert [line.split()[:2] for line in calls[:4]] == [
        ["-"], ["bench.py", "--attention-backend"], ["bench.py", "--attention-micro"], ["-c", "import"]]
    assert sorted(calls[4:]) == ["-m pytest -q -rfEs -m cuda", "-m pytest -q -rfEs -m not cuda"]  # the latter beside
    out = result.stdout
    assert out.index("bench: 123 tok/s") < out.index("micro: 45 us") < out.index("cpu: 30 passed") < \
        out.rindex("FAILED tests/x.py::test_y")
