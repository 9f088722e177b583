"""torch's private names, reached in one module only, each with a public fallback.

On a torch where a private name distkit uses is gone (a release after the newest tested),
distkit takes its public path instead of breaking: these tests remove the names and run
the collectives.
"""

from __future__ import annotations

import ast

from conftest import ROOT
from helpers_subprocess import run

WITHOUT_PRIVATE_NAMES = """
import sys, torch, torch.distributed as td
from torch.distributed import distributed_c10d as c10d

# what a torch without distkit's private names looks like, before distkit is imported
saved = torch._C._has_torch_function_unary
del torch._C._has_torch_function_unary
counted = torch._C._storage_Use_Count
del torch._C._storage_Use_Count
del torch._utils._flatten_dense_tensors, torch._utils._unflatten_dense_tensors
sys.modules["torch.distributed._functional_collectives"] = None
import distkit, distkit.dist as dist
from distkit import _compat
_compat.torch_registry = lambda: _compat._PublicRegistry()  # no registry (nor its record
# of coalescing): the public API, and the lean lane steps aside
torch._C._has_torch_function_unary = saved  # torch itself needs it; distkit saw it gone
torch._C._storage_Use_Count = counted
assert _compat.has_torch_function_unary is None
assert _compat.storage_use_count(torch.ones(1).untyped_storage()) is None
assert _compat.functional_collectives() is None


def body():
    rank, size = dist.get_rank(), dist.get_world_size()
    out = []
    for _ in range(4):  # the plain all_reduce: the lean lane steps aside
        out.append(dist.all_reduce(torch.ones(2)).tolist())
    out.append([t.tolist() for t in dist.all_gather(torch.arange(rank + 1))])
    out.append(dist.broadcast(torch.tensor([rank]), src=1).tolist())
    out.append(dist.reduce_scatter(torch.arange(2.0 * size)).tolist())
    out.append([t.tolist() for t in dist.all_to_all([torch.ones(r + 1) for r in range(size)])])
    out.append(dist.all_gather_object({"rank": rank}))
    params = [torch.ones(3), torch.ones(2, dtype=torch.int64)]
    out.append([p.tolist() for p in dist.all_reduce_params(params)])
    # point to point: the lanes step aside, and no receive buffer is taken for unused
    for k in range(3):
        got = dist.send(torch.full((2,), k), 1) if rank == 0 else dist.recv(0)
        out.append(None if got is None else got.tolist())
    return out


print(distkit.launch(body, nprocs=2, timeout=120))
"""


def test_collectives_run_without_torchs_private_names():
    proc = run(["-c", WITHOUT_PRIVATE_NAMES], timeout=240)
    results = eval(proc.stdout.strip().splitlines()[-1])
    for rank, out in enumerate(results):
        assert out[:4] == [[2.0, 2.0]] * 4
        assert out[4] == [[0], [0, 1]]
        assert out[5] == [1]
        assert out[6] == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)]
        assert out[7] == [[1.0] * (rank + 1)] * 2
        assert out[8] == [{"rank": 0}, {"rank": 1}]
        assert out[9] == [[2.0, 2.0, 2.0], [2, 2]]
        assert out[10:] == ([None] * 3 if rank == 0 else [[k, k] for k in range(3)])


#: What only distkit/_compat.py may reach: torch's underscored names
PRIVATE_OK = {"distkit/_compat.py"}


def _private_torch_names(path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts) or any(
                n.startswith("_") and not n.startswith("__") for n in names
            ):
                found.append(f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and any(
                    p.startswith("_") for p in alias.name.split(".")
                ):
                    found.append(f"import {alias.name}")
        elif isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in ("torch", "td", "c10d"):
                chain.append(value.id)
                chain.reverse()
                if any(p.startswith("_") and not p.startswith("__") for p in chain[1:]):
                    found.append(".".join(chain))
    return found


def test_torchs_private_names_are_reached_in_compat_only():
    offenders = {}
    for path in sorted((ROOT / "distkit").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in PRIVATE_OK:
            continue
        found = _private_torch_names(path)
        if found:
            offenders[rel] = sorted(set(found))
    assert not offenders, offenders


def test_the_scan_sees_private_names(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import torch\nimport torch.distributed._functional_collectives as fc\n"
        "from torch._utils import x\nf = torch._C._has_torch_function_unary\n"
    )
    assert len(set(_private_torch_names(module))) >= 3
