"""The house rules of the package layout, checked on the source.

Owns the rules from docs/ARCHITECTURE.md ("Layout: two processes, one shared floor"):
- Which modules each process may load. A mount process loads the mount package
  (silofs/mount/), the shared floor and the client side of the control socket, never a
  node module (the daemon, its fetcher, its SDKs); the daemon loads the node package,
  the shared floor and the server side, never a mount module. The floor imports neither
  side. Module names are compared whole, package by package: "silofs.mount" is the
  package and what is below it, not silofs.mountinfo.
- The shared floor holds only what both processes run: every module of silofs/cache/ is
  loaded by both, every public name one of them defines is used by a mount module and
  by a node module (directly, or through another floor name they use), and no floor
  module writes the env (the daemon's write side is node/store_write.py and
  node/listing_builder.py). The exception: what describes a byte layout stays with
  the layout (FORMAT), the encoders beside the decoders that read their bytes.
- No import cycle anywhere in silofs/ or silofs_ctl/ (imports inside functions count: a
  lazy import is still a dependency), and silofs_ctl imports only the client side.

The trees checked are those of the silofs and silofs_ctl packages Python imports, so
the rules can be run against another checkout by putting it first on PYTHONPATH.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import silofs_ctl

import silofs

PACKAGES = {
    "silofs": Path(silofs.__file__).resolve().parent,
    "silofs_ctl": Path(silofs_ctl.__file__).resolve().parent,
}
MOUNT, NODE = "silofs.mount", "silofs.node"
CACHE = "silofs.cache"

# What both processes load: the shared floor.
FLOOR = frozenset(
    {
        "silofs.cache.bounds",
        "silofs.cache.format",
        "silofs.cache.listing",
        "silofs.cache.rows",
        "silofs.cache.store",
        "silofs.config",
        "silofs.control.peer",
        "silofs.control.tls",
        "silofs.errors",
        "silofs.flight",
        "silofs.heap",
        "silofs.logsetup",
        "silofs.records",
        "silofs.sealed",
        "silofs.trace",
        "silofs.units",
        "silofs.uri",
    }
)
# Besides its own package and the floor, what each process may load.
MAY_LOAD = {
    # The client side of the control socket, as the CLI uses it.
    MOUNT: frozenset({"silofs.control.client", "silofs.mountinfo"}),
    # The server side of the control socket, and the package's version; whether a
    # mount's pid is alive (the reaper), as the CLI asks it.
    NODE: frozenset(
        {
            "silofs.control.thread_conn",
            "silofs.control.router",
            "silofs.control.server",
            "silofs.pids",
        }
    ),
}
# The packages above them, which importing any of them loads.
PACKAGE_INITS = frozenset({"silofs", "silofs.cache", "silofs.control"})
# What describes a byte layout stays with the layout although only the daemon (or only
# the tests) use it: one module owns one layout, and a golden-bytes test pins the
# chunk's. The encoders beside the decoders that read their bytes, the chunk header's
# full decoder, the chunk key's size.
FORMAT = frozenset(
    {
        ("silofs.cache.format", "ChunkHeader"),
        ("silofs.cache.format", "ChunkValue"),
        ("silofs.cache.format", "KEY_SIZE"),
        ("silofs.cache.format", "decode_header"),
        ("silofs.cache.format", "encode_chunk"),
        ("silofs.cache.listing", "encode_dir"),
        ("silofs.cache.listing", "encode_file"),
        ("silofs.cache.listing", "pack_cid"),
    }
)
# Code of the floor that writes an LMDB env of its own, never the cache's.
SCRATCH_ENVS = frozenset({("silofs.cache.bounds", "_find_val_offset")})


def in_package(module: str, package: str) -> bool:
    """Whether `module` is `package` or below it (silofs.mountinfo is not silofs.mount)."""
    return module == package or module.startswith(package + ".")


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


def _existing(name: str, modules: dict[str, Path]) -> str:
    """The most specific module of the project that `name` names, or ""."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (the most specific ones that exist)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            found: set[str] = set()
            if isinstance(node, ast.Import):
                found = {_existing(a.name, modules) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, path.name == "__init__.py", node)
                # Each imported name may be a module of its own (from pkg import a, b);
                # the package itself only when none is.
                found = {_existing(f"{target}.{a.name}", modules) for a in node.names}
                found = {f for f in found if f != _existing(target, modules)}
                found = found or {_existing(target, modules)}
            graph[mod] |= {f for f in found if f and f != mod}
    return graph


def _closure(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def loads(graph: dict[str, set[str]], side: str) -> set[str]:
    """Every module a process of `side` (MOUNT or NODE) may import: its package's and
    what they import, lazily or not."""
    return _closure(graph, [m for m in graph if in_package(m, side)])


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


# -- which modules each process loads ------------------------------------------------
def test_package_boundaries_are_whole_names() -> None:
    assert in_package("silofs.mount", MOUNT) and in_package("silofs.mount.fs", MOUNT)
    assert not in_package("silofs.mountinfo", MOUNT)
    assert not in_package("silofs.nodes", NODE)


def test_the_mount_side_never_imports_the_node_side() -> None:
    graph = import_graph()
    assert any(in_package(m, MOUNT) and m != MOUNT for m in graph), "no mount package found"
    bad = [
        f"{mod} imports {dep}"
        for mod, deps in graph.items()
        if in_package(mod, MOUNT)
        for dep in deps
        if in_package(dep, NODE)
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("side", [MOUNT, NODE])
def test_each_process_loads_only_its_package_the_floor_and_what_it_may(side: str) -> None:
    graph = import_graph()
    allowed = FLOOR | PACKAGE_INITS | MAY_LOAD[side]
    bad = sorted(m for m in loads(graph, side) if not in_package(m, side) and m not in allowed)
    assert not bad, f"a {side} process would load: " + ", ".join(bad)


def test_the_floor_is_what_both_processes_load() -> None:
    graph = import_graph()
    both = loads(graph, MOUNT) & loads(graph, NODE)
    cache = {m for m in graph if in_package(m, CACHE) and m != CACHE}
    assert cache <= FLOOR, f"cache modules missing from FLOOR: {sorted(cache - FLOOR)}"
    assert FLOOR <= both, f"floor modules one process never loads: {sorted(FLOOR - both)}"


def test_the_floor_imports_neither_side() -> None:
    graph = import_graph()
    sides = (
        NODE,
        MOUNT,
        "silofs.cli",
        "silofs.cli_mount",
        "silofs.demo",
        "silofs.jobend",
        "silofs.deadmounts",
        "silofs.unmount",
    )
    shared = [
        m
        for m in graph
        if in_package(m, "silofs")
        and m != "silofs.__main__"
        and not any(in_package(m, s) for s in sides)
    ]
    bad = [
        f"{m} imports {d}" for m in shared for d in graph[m] if any(in_package(d, s) for s in sides)
    ]
    assert not bad, "\n".join(bad)


# -- the floor holds only what both run ------------------------------------------------
def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """A module's top-level names (functions, classes, assigned names) -> their node."""
    out: dict[str, ast.AST] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = stmt
    return out


def _identifiers(node: ast.AST) -> set[str]:
    """Every name `node` mentions: variables, attributes, names it imports."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            out.add(n.name.rpartition(".")[2])
    return out


def floor_users(graph: dict[str, set[str]]) -> dict[tuple[str, str], set[str]]:
    """(floor module, top-level name) -> the sides (MOUNT, NODE) that use it: a module of
    the side imports the floor module and mentions the name, or a floor name a side uses
    mentions it (in the same module, or in one that imports the floor module)."""
    modules = _modules()
    floor = [m for m in graph if in_package(m, CACHE) and m != CACHE]
    defs: dict[tuple[str, str], ast.AST] = {}
    for m in floor:
        for name, node in _top_level(ast.parse(modules[m].read_text())).items():
            defs[(m, name)] = node
    # A layout's names count as both sides': what they use is part of the layout too.
    users = {k: {MOUNT, NODE} if k in FORMAT else set() for k in defs}
    for side in (MOUNT, NODE):
        for mod in (m for m in graph if in_package(m, side)):
            said = _identifiers(ast.parse(modules[mod].read_text()))
            for fm, name in defs:
                if fm in graph[mod] and name in said:
                    users[(fm, name)].add(side)
    said_by = {k: _identifiers(node) for k, node in defs.items()}
    changed = True
    while changed:
        changed = False
        for (um, uname), sides in users.items():
            for fm, name in defs:
                reach = fm == um or fm in graph[um]
                if reach and name in said_by[(um, uname)] and not sides <= users[(fm, name)]:
                    users[(fm, name)] |= sides
                    changed = True
    return users


def test_every_public_floor_name_is_used_by_both_processes() -> None:
    users = floor_users(import_graph())
    bad = [
        f"{m}.{name}: used only by {', '.join(sorted(sides)) or 'neither process'}"
        for (m, name), sides in sorted(users.items())
        if not name.startswith("_") and sides != {MOUNT, NODE}
    ]
    assert not bad, "the shared floor holds code one process never runs:\n" + "\n".join(bad)


def test_the_floor_never_writes_the_env() -> None:
    """No write txn and no put/delete/drop in silofs/cache/: the one writer is the
    daemon's (node/store_write.py, node/listing_builder.py)."""
    modules = _modules()
    bad: list[tuple[str, int, str]] = []
    for mod, path in sorted(modules.items()):
        if not in_package(mod, CACHE):
            continue
        tree = ast.parse(path.read_text())
        scratch = [n for name, n in _top_level(tree).items() if (mod, name) in SCRATCH_ENVS]
        skip = {id(c) for n in scratch for c in ast.walk(n)}
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call) or id(n) in skip:
                continue
            kws = {k.arg: k.value for k in n.keywords}
            write = kws.get("write")
            if isinstance(write, ast.Constant) and write.value is True:
                bad.append((mod, n.lineno, "begins a write txn"))
            fn = n.func
            if isinstance(fn, ast.Attribute) and fn.attr in ("put", "putmulti", "drop", "delete"):
                if "db" in kws or (fn.attr == "delete" and not n.args):
                    bad.append((mod, n.lineno, f"{fn.attr}s in the env"))
    assert not bad, "\n".join(f"{m}:{line} {what}" for m, line, what in sorted(bad))


# -- the rest of the tree ---------------------------------------------------------------
def test_the_controller_imports_only_the_shared_client_side() -> None:
    graph = import_graph()
    # silofs.records: the job name grammar (one place, stdlib only), so silofs-ctl can
    # name a bad JOB argument before any request, and `shown` for what it prints.
    # silofs.logsetup: the log formatter that escapes a message as the daemon's does.
    # silofs.output: output that cannot be written ended as `silofs` ends it (stdlib only).
    allowed = (
        "silofs.output",
        "silofs.logsetup",
        "silofs.units",
        "silofs.errors",
        "silofs.config",
        "silofs.control.client",
        "silofs.records",
        "silofs.sealed",
        "silofs.trace",
    )
    bad = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if in_package(m, "silofs_ctl")
        for d in deps
        if in_package(d, "silofs") and d not in allowed
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


def _loaded(imports: str) -> set[str]:
    """The silofs modules a fresh interpreter has loaded after `imports`."""
    code = (
        f"import sys; {imports}; print(','.join(m for m in sys.modules if m.startswith('silofs')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.strip().split(","))


def test_a_mount_process_loads_no_node_module() -> None:
    """The same rules at run time: what importing the mount side really loads."""
    got = _loaded("import silofs.mount.process, silofs.mount.fs, silofs.mount.reader")
    assert "silofs.mount.process" in got
    bad = sorted(
        m
        for m in got
        if not in_package(m, MOUNT) and m not in FLOOR | PACKAGE_INITS | MAY_LOAD[MOUNT]
    )
    assert not bad, "a mount process loads " + ", ".join(bad)


def test_the_daemon_loads_no_mount_module() -> None:
    got = _loaded("import silofs.node.service")
    assert "silofs.node.service" in got
    assert not [m for m in got if in_package(m, MOUNT)]


def test_the_graph_sees_real_edges() -> None:
    graph = import_graph()
    assert "silofs.cache.format" in graph["silofs.mount.reader"]
    assert "silofs.node.routes" in graph["silofs.node.service"]
    assert "silofs.mountinfo" in graph["silofs.mount.process"]
