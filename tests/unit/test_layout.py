"""The house rules of the package layout, checked on the source.

Owns two rules from docs/ARCHITECTURE.md: a module of the mount side (silofs/mount/)
never imports one of the node side (silofs/node/), so a mount process never loads the
daemon, its fetcher or its SDKs; and no import cycle exists anywhere in silofs/ or
silofs_ctl/ (imports inside functions count: a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"silofs": ROOT / "silofs", "silofs_ctl": ROOT / "silofs-ctl" / "silofs_ctl"}


def _module_name(pkg: str, base: Path, path: Path) -> str:
    parts = [pkg, *path.relative_to(base).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            out[_module_name(pkg, base, path)] = path
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (the most specific one that exists)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, path.name == "__init__.py", node)
                names = [f"{target}.{a.name}" for a in node.names] + [target]
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
                    break
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_mount_side_never_imports_the_node_side() -> None:
    graph = import_graph()
    assert any(m.startswith("silofs.mount.") for m in graph), "no mount package found"
    bad = [
        f"{mod} imports {dep}"
        for mod, deps in graph.items()
        if mod.startswith("silofs.mount")
        for dep in deps
        if dep.startswith("silofs.node")
    ]
    assert not bad, "\n".join(bad)


def test_shared_modules_import_neither_side() -> None:
    graph = import_graph()
    sides = ("silofs.node", "silofs.mount", "silofs.cli", "silofs.demo", "silofs.jobend")
    shared = [m for m in graph if m.startswith("silofs") and not m.startswith(sides)]
    shared = [m for m in shared if not m.startswith("silofs_ctl") and m != "silofs.__main__"]
    bad = [f"{m} imports {d}" for m in shared for d in graph[m] if d.startswith(sides)]
    assert not bad, "\n".join(bad)


def test_the_controller_imports_only_the_shared_client_side() -> None:
    graph = import_graph()
    # silofs.records: the job name grammar (one place, stdlib only), so silofs-ctl can
    # name a bad JOB argument before any request.
    allowed = (
        "silofs.units",
        "silofs.errors",
        "silofs.config",
        "silofs.control.client",
        "silofs.records",
    )
    bad = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m.startswith("silofs_ctl")
        for d in deps
        if d.startswith("silofs.") and d not in allowed
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph: dict, expected: list) -> None:
    assert _cycles(graph) == expected


def test_a_mount_process_loads_no_node_module() -> None:
    """The same rule at run time: what importing the mount side really loads."""
    import subprocess
    import sys

    code = (
        "import sys, silofs.mount.process, silofs.mount.fs, silofs.mount.reader;"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('silofs.node'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_graph_sees_real_edges() -> None:
    graph = import_graph()
    assert "silofs.cache.format" in graph["silofs.mount.reader"]
    assert "silofs.node.routes" in graph["silofs.node.service"]
