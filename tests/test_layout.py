"""The package's import graph runs one way: public API, then backends, then the wire.

Every import between distkit's modules counts, function-local ones too (a lazy import
is still a dependency); imports under ``if TYPE_CHECKING:`` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

# Lower layers never import higher ones. The README's Development section draws this.
LAYERS = [
    # 0: torch's registry and version shims, settings, and the utilities
    {"distkit._registry", "distkit._compat", "distkit._settings", "distkit._lazy"}
    | {"distkit.utils", "distkit.utils.console", "distkit.utils.device"}
    | {"distkit.utils.environ", "distkit.utils.groups"},
    # 1: what backends are built from: argument checks, ops, the wire format, debug mode
    {
        "distkit.dist._args",
        "distkit.dist._ops",
        "distkit.dist.handle",
        "distkit.dist.serializer",
        "distkit.dist._pickling",
        "distkit.dist._wire",
        "distkit.dist._safe",
        "distkit.dist._plain",
        "distkit.dist._opcodes",
        "distkit.dist.debug",
        "distkit.dist.timeouts",
        "distkit.dist._board",
        "distkit.dist._check",
        "distkit.dist._watchdog",
        "distkit.dist._watch",
        "distkit.dist._backend",
    },
    # 2: the backends
    {"distkit.dist._single", "distkit.dist._torch", "distkit.dist._torch_objects"}
    | {"distkit.dist._uneven", "distkit.dist._gloo", "distkit.dist._stream"}
    | {"distkit.dist._traced"},
    # 3: the decision point
    {"distkit.dist._comm", "distkit.dist._shortcut", "distkit.dist._lane"},
    # 4: the public API
    {
        "distkit.dist",
        "distkit.dist.tensor",
        "distkit.dist._autograd",
        "distkit.dist.objects",
        "distkit.dist.world",
        "distkit.dist.init",
        "distkit.dist.helpers",
        "distkit.dist.evaluation",
    },
    # mmengine's import paths (distkit.dist.dist, distkit.dist.utils): re-exports only
    {"distkit.dist.dist", "distkit.dist.utils"},
    # 5: tools built on the API
    {"distkit", "distkit.__main__", "distkit.cli", "distkit.bench"}
    | {"distkit.local", "distkit.local.pool", "distkit.local.worker", "distkit.local.launch"}
    | {"distkit.local.script", "distkit.local.hygiene"},
    # 6: the test harness, which nothing in the library may import
    {"distkit.testing", "distkit.testing.plugin"},
]


def modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "distkit").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def test_every_module_has_a_layer():
    placed = set().union(*LAYERS)
    assert set(modules()) == placed, {"unplaced": set(modules()) - placed}


def test_imports_never_go_up_a_layer():
    mods = modules()
    layer = {m: i for i, group in enumerate(LAYERS) for m in group}
    upward = []
    for name, path in mods.items():
        for target in imports(path, set(mods)):
            # a package's __init__ is how its modules are reached: not a dependency
            if target in ("distkit", "distkit.dist", "distkit.utils", "distkit.local"):
                continue
            if layer[target] > layer[name]:
                upward.append(f"{name} (layer {layer[name]}) imports {target} ({layer[target]})")
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(p, set(mods)) - {m} for m, p in mods.items()}
    for pkg in ("distkit", "distkit.dist", "distkit.utils", "distkit.local"):
        for deps in graph.values():
            deps.discard(pkg)
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])
