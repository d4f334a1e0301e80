"""The import graph of nanovllm's modules (counting imports inside functions too): no circles, and every import
goes down (or across) the floors of the house, never up."""
import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nanovllm"

FLOORS = [
    ("bookkeeping, tensor-free", ["nanovllm.sampling_params", "nanovllm.outputs", "nanovllm.core", "nanovllm.config",
                                  "nanovllm.cache", "nanovllm.progress", "nanovllm.parallel.supervisor",
                                  "nanovllm.spec_decode", "nanovllm.metrics"]),
    ("the tensor-parallel group", ["nanovllm.parallel.process_group"]),
    ("kernels and layers", ["nanovllm.backends", "nanovllm.quantization", "nanovllm.layers"]),
    ("models and their weights", ["nanovllm.models", "nanovllm.gguf_import"]),
    ("running a model", ["nanovllm.execution", "nanovllm.parallel.tensor_parallel", "nanovllm.spec_decode.verifier",
                         "nanovllm.spec_decode.draft_model",
                         "nanovllm.structured_output"]),
    ("the engine", ["nanovllm.engine", "nanovllm.spec_decode.draft_check"]),
    ("entry points", ["nanovllm", "nanovllm.llm", "nanovllm.parallel", "nanovllm.ray", "nanovllm.smollm2",
                      "nanovllm.cli", "nanovllm.__main__", "nanovllm.program", "nanovllm.benchmarks"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The nanovllm modules `path` imports (`from pkg import name` counts as pkg.name when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                         for alias in node.names)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}


def floor(module: str) -> int:
    """The floor of `module`: that of the longest listed prefix."""
    matches = [(len(prefix), level) for level, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is on no floor: add it to FLOORS"
    return max(matches)[1]


def test_no_import_cycles():
    graph = import_graph()
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        assert name not in trail, f"import circle: {' -> '.join(trail[trail.index(name):] + [name])}"
        if name not in done:
            for imported in sorted(graph[name]):
                visit(imported, trail + [name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert "nanovllm.execution.model_runner" in graph["nanovllm.engine.llm_engine"]


def test_no_utils_and_the_parallel_pieces_in_one_room():
    assert not (PACKAGE / "utils").exists()
    spawning = sorted(name for name, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
                      if "Process(" in path.read_text() or "get_context(\"spawn\")" in path.read_text())
    assert spawning == ["nanovllm.parallel.supervisor"], spawning


def test_every_import_goes_down_the_floors():
    upward = [f"{name} ({FLOORS[floor(name)][0]}) imports {imported} ({FLOORS[floor(imported)][0]})"
              for name, imports in sorted(import_graph().items()) for imported in sorted(imports)
              if floor(imported) > floor(name)]
    assert not upward, "imports that go up a floor:\n" + "\n".join(upward)


def test_the_core_and_the_settings_import_neither_torch_nor_the_engine():
    code = ("import sys, nanovllm.core.scheduler, nanovllm.core.stopping, nanovllm.config\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m in ('nanovllm.backends', 'nanovllm.engine', 'nanovllm.execution', 'nanovllm.models')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
