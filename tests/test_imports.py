"""No import circles among nanovllm's modules, counting imports inside functions too."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanovllm"


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


def test_no_import_cycles():
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}
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
