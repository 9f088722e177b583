"""The package's import graph runs one way, one layer per folder, with no cycle.

Every import between distkit's modules counts: function-local ones (a lazy import is
still a dependency) and those under ``if TYPE_CHECKING:`` (a cycle that only the type
checker sees is still a cycle in the reader's head). CONTRIBUTING.md draws the layers
(the documentation's Development page shows it).
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

#: Lower layers never import higher ones; a module imports only its own layer or lower.
LAYERS = [
    # 0: torch's registry and version shims, settings, and the utilities
    {"distkit._registry", "distkit._compat", "distkit._settings", "distkit._lazy"}
    | {"distkit.utils", "distkit.utils.console", "distkit.utils.device"}
    | {"distkit.utils.environ", "distkit.utils.groups"},
    # 1: the lowest floor of distkit.dist: values, checks, specs, layouts; public leaves
    {"distkit.dist.core", "distkit.dist.core.comm", "distkit.dist.core.args"}
    | {"distkit.dist.core.shortcut", "distkit.dist.core.spec", "distkit.dist.core.layouts"}
    | {"distkit.dist.errors", "distkit.dist.handle"},
    # 2: what backends are built from: the object codec, and what guards every call
    {"distkit.dist.codec", "distkit.dist.codec.wire", "distkit.dist.codec.pickling"}
    | {"distkit.dist.codec.policy", "distkit.dist.codec.safe", "distkit.dist.codec.builders"}
    | {"distkit.dist.codec.opcodes", "distkit.dist.guard", "distkit.dist.guard.watch"}
    | {"distkit.dist.guard.debugmode", "distkit.dist.guard.check", "distkit.dist.guard.board"}
    | {"distkit.dist.guard.watchdog", "distkit.dist.guard.diagnose", "distkit.dist.guard.record"}
    | {"distkit.dist.guard.pairs", "distkit.dist.guard.creation"},
    # 3: the backends
    {"distkit.dist.backends", "distkit.dist.backends.base", "distkit.dist.backends.single"}
    | {"distkit.dist.backends.tensors", "distkit.dist.backends.objects"}
    | {"distkit.dist.backends.gloo"}
    | {"distkit.dist.backends.uneven", "distkit.dist.backends.stream", "distkit.dist.backends.p2p"}
    | {"distkit.dist.backends.traced"},
    # 4: the decision point: which group, which backend
    {"distkit.dist._route", "distkit.dist._autograd"},
    # 5: the public API
    {
        "distkit.dist",
        "distkit.dist.tensor",
        "distkit.dist.objects",
        "distkit.dist.world",
        "distkit.dist.init",
        "distkit.dist.helpers",
        "distkit.dist.evaluation",
        "distkit.dist.debug",
        "distkit.dist.serializer",
        "distkit.dist.profiling",
        "distkit.dist.p2p",
    },
    # mmengine's import paths (distkit.dist.dist, distkit.dist.utils): re-exports only
    {"distkit.dist.dist", "distkit.dist.utils"},
    # 6: tools built on the API
    {"distkit", "distkit.__main__", "distkit.cli", "distkit.bench"}
    | {"distkit.bench_peers", "distkit.scale_bench", "distkit.scale_model"}
    | {"distkit.local", "distkit.local.pool", "distkit.local.worker", "distkit.local.launch"}
    | {"distkit.local.script", "distkit.local.hygiene"},
    # 7: the test harness, which nothing in the library may import
    {"distkit.testing", "distkit.testing.plugin"},
]

#: Private modules allowed at the top of distkit.dist (the rest live in a subpackage)
TOP_PRIVATE = {"distkit.dist._route", "distkit.dist._autograd"}


def modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "distkit").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """Every distkit module ``path`` imports: at the top, in functions, under
    ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


PACKAGES = {
    "distkit",
    "distkit.dist",
    "distkit.utils",
    "distkit.local",
    "distkit.dist.core",
    "distkit.dist.guard",
    "distkit.dist.codec",
    "distkit.dist.backends",
}


def test_the_top_floor_of_distkit_dist_is_its_public_face():
    top = {m for m in modules() if m.count(".") == 2 and m.startswith("distkit.dist.")}
    private = {m for m in top if m.rsplit(".", 1)[1].startswith("_")}
    assert private == TOP_PRIVATE, private
    assert len(private) <= 4


def test_the_test_of_import_cycles_sees_type_checking_imports(tmp_path):
    """``imports`` counts what only the type checker runs: a cycle through it fails."""
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import b\n"
        "def f():\n    from c import d\n"
    )
    assert imports(module, {"a", "a.b", "c", "c.d"}) == {"a", "a.b", "c", "c.d"}


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
            if target in PACKAGES:
                continue
            if layer[target] > layer[name]:
                upward.append(f"{name} (layer {layer[name]}) imports {target} ({layer[target]})")
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(p, set(mods)) - {m} for m, p in mods.items()}
    for pkg in PACKAGES:
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
