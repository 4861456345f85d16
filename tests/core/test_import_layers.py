"""No import circles in the core: a module never imports, directly or through others, a module that imports it.

Read statically (``ast``), so a circle fails here and not only in the order some program happens to import
things. Counted: imports at module level and inside functions (a function-level import done to dodge a
circle is still one). Not counted: imports under ``if TYPE_CHECKING:``, which never run (annotations only).
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core" / "hybridrl"

#: circles known and left to the change that rewrites those modules: {modules: why}.
KNOWN: dict[frozenset[str], str] = {
    frozenset({"hybridrl.placement.memory", "hybridrl.placement.host_memory"}):
        "render_memory appends host_memory's table lazily; placement's memory modules are being rewritten",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in CORE.rglob("*.py"):
        parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The core modules ``name`` imports (a ``from package import module`` names the module)."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                out.update(filter(None, (known(a.name) for a in child.names)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                out.update(filter(None, (known(f"{base}.{a.name}") for a in child.names)))
            visit(child)

    visit(ast.parse(path.read_text()))
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan), i.e. the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_reader_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [{"a", "b", "c"}]
    real = import_graph()
    assert "hybridrl.run.faults" in real["hybridrl.run.checkpoint"]  # module level
    assert "hybridrl.environments.runner" in real["hybridrl.engines.contracts"]  # inside a method: counted
    assert "hybridrl.engines.contracts" not in real["hybridrl.environments.runner"]  # under TYPE_CHECKING: not


def test_the_core_has_no_import_circle() -> None:
    graph = import_graph()
    found = [c for c in circles(graph) if frozenset(c) not in KNOWN]
    described = ["; ".join(f"{a} -> {b}" for a in sorted(c) for b in sorted(graph[a] & c)) for c in found]
    assert not found, "import circles: " + " | ".join(described)


def test_the_circles_once_found_stay_broken() -> None:
    graph = import_graph()
    for low, high in [("hybridrl.run.faults", "hybridrl.run.run_folder"),
                      ("hybridrl.run.faults", "hybridrl.run.checkpoint"),
                      ("hybridrl.engines.rollout_kit", "hybridrl.engines.contracts"),
                      ("hybridrl.run.validation", "hybridrl.run.trainer")]:
        assert high not in graph[low], f"{low} imports {high} again"
