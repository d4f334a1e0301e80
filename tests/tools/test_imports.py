"""The import graph of nanovllm's modules (counting imports inside functions too): a folder is one layer of the house,
every import goes down (or stays in its folder), and there are no circles."""
import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nanovllm"

# The package's folders, bottom first: a module's layer is its folder's. The package's own top-level modules are plain
# data and settings, below every folder, except the entry points, above them all.
FOLDERS = ["core", "spec_decode", "distributed", "kernels", "layers", "models", "lora", "structured_output",
           "execution", "engine", "v1", "renderers"]
ENTRY_POINTS = ["nanovllm", "nanovllm.__main__", "nanovllm.llm", "nanovllm.llm_pooling", "nanovllm.cli",
                "nanovllm.program", "nanovllm.ray", "nanovllm.entrypoints", "nanovllm.entrypoints.llm"]


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


def layer(module: str) -> tuple[int, str]:
    """`module`'s layer (0 is the bottom) and its name: its folder's, or for a top-level module, plain data or an entry
    point."""
    parts = module.split(".")
    if module in ENTRY_POINTS:
        return len(FOLDERS) + 1, "entry points"
    if len(parts) == 2 and not (PACKAGE / parts[1]).is_dir():
        return 0, "plain data and settings"
    assert parts[1] in FOLDERS, f"nanovllm/{parts[1]}/ is on no layer: add it to FOLDERS in {__file__}"
    return FOLDERS.index(parts[1]) + 1, f"{parts[1]}/"


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle of `graph` (node -> the nodes it imports), or None."""
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> list[str] | None:
        if name in trail:
            return trail[trail.index(name):] + [name]
        if name in done:
            return None
        found = next(filter(None, (visit(imported, trail + [name]) for imported in sorted(graph.get(name, ())))), None)
        done.add(name)
        return found

    return next(filter(None, (visit(name, []) for name in sorted(graph))), None)


def test_no_import_cycles():
    graph = import_graph()
    assert circle(graph) is None, f"import circle: {' -> '.join(circle(graph))}"
    assert "nanovllm.execution.model_runner" in graph["nanovllm.engine.llm_engine"]


def test_no_folder_cycles():
    """Drawn with folders (and top-level modules) as rooms, as `../shared/hooks/folder_cycles.py` draws them."""
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    rooms: dict[str, set[str]] = {}
    for name, imports in import_graph().items():
        rooms.setdefault(room(name), set()).update(room(imported) for imported in imports)
        rooms[room(name)].discard(room(name))
    rooms.pop("nanovllm", None)  # the package's __init__ only re-exports
    assert circle(rooms) is None, f"folders in a circle: {' -> '.join(circle(rooms))}"


def test_no_utils_and_the_parallel_pieces_in_one_room():
    assert not (PACKAGE / "utils").exists()
    spawning = sorted(name for name, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
                      if "Process(" in path.read_text() or "get_context(\"spawn\")" in path.read_text())
    assert spawning == ["nanovllm.distributed.supervisor"], spawning


def test_every_import_goes_down_the_layers():
    upward = [f"{name} ({layer(name)[1]}) imports {imported} ({layer(imported)[1]})"
              for name, imports in sorted(import_graph().items()) for imported in sorted(imports)
              if layer(imported)[0] > layer(name)[0]]
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_the_core_and_the_settings_import_neither_torch_nor_the_engine():
    code = ("import sys, nanovllm.config, nanovllm.core.scheduler, nanovllm.core.stopping\n"
            "import nanovllm.spec_decode.proposer, nanovllm.spec_decode.grammar_drafts, nanovllm.spec_decode.stats\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m in ('nanovllm.kernels', 'nanovllm.engine', 'nanovllm.execution', 'nanovllm.models')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
