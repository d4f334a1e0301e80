import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "example.py"


def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300)


def test_example_prints_completions(tied_model):
    result = run_example("--model", tied_model, "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Completion: ") == 2
    streamed = run_example("--model", tied_model, "--max-tokens", "4", "--stream")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.count("Completion: ") == 2


def test_example_explains_a_bad_model_path(tmp_path):
    result = run_example("--model", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "model directory not found" in result.stderr
    result = run_example("--model", str(tmp_path))
    assert result.returncode == 2
    assert "no config.json" in result.stderr
