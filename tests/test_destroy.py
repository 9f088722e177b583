"""Tearing worlds down never deadlocks, on every torch distkit supports.

On torch before 2.8, destroying a gloo group can deadlock: ``~ProcessGroup`` joins gloo's
worker threads while holding the GIL, and a worker may be freeing a tensor, which needs
the GIL. ``distkit._compat.destroy`` avoids it by letting the group go before its backend.
Without that, this loop hung within its first 150 cycles on torch 2.4.1 (every run); on
torch 2.8 and newer 25 cycles check that nothing else broke. Its last world checks that
``destroy_dist`` leaves nothing holding a group, so every backend is joined before exit.
"""

from __future__ import annotations

import ast

import torch
from conftest import ROOT, _torch_version
from helpers_subprocess import run

from distkit.dist.codec.wire import owned_bytes

LOOP = """
import os, sys, tempfile, torch, torch.distributed as td
import distkit.dist as dist
from torch.multiprocessing import spawn

def body(rank, path, n):
    for i in range(n - 1):
        td.init_process_group("gloo", init_method=f"file://{path}.{i}", rank=rank, world_size=2)
        shards = dist.all_gather(torch.arange(rank + 1.0))
        dist.all_reduce(torch.tensor(float(rank)), op="mean")
        dist.gather_object({"rank": rank, "sizes": [len(s) for s in shards]})
        dist.all_gather_object([torch.ones(3)])
        dist.destroy_dist()
    # the last world as a script makes it, using every part of distkit that keeps state
    # between calls: once destroy_dist returns, nothing may hold the group (a group held
    # keeps its gloo backend alive into the interpreter's teardown, where its threads
    # can abort the process after a run that succeeded)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # unused: a file store
    dist.init_dist("pytorch", init_method=f"file://{path}.last")
    with dist.profile() as kept:  # a profile a script keeps to the end
        dist.all_reduce(torch.ones(1), group=[0, 1])
    dist.init_local_group(0, 2)
    dist.all_reduce(torch.ones(1), group=dist.get_local_group())
    dist.exchange({1 - rank: torch.ones(2)}, [1 - rank])
    kept_handle = dist.all_reduce(torch.ones(1), async_op=True)  # kept, once waited
    assert kept_handle.wait().item() == 2
    dist.send({"t": torch.ones(3)}, 1) if rank == 0 else dist.recv(0)
    list(dist.iter_results([rank], 2))
    dist.set_debug(True)
    dist.broadcast_object(rank)
    dist.set_debug(False)
    dist.destroy_dist()
    from distkit import _compat
    assert _compat._lingering == [], f"rank {rank}: a destroyed group is still held"
    assert kept.rows is not None

if __name__ == "__main__":
    spawn(body, args=(os.path.join(tempfile.mkdtemp(), "store"), int(sys.argv[1])), nprocs=2)
    print("cycles done")
"""


def test_destroying_worlds_in_a_loop_never_deadlocks(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    # where torch itself cannot deadlock here (2.8 and newer), fewer cycles show that
    # nothing else broke
    cycles = "100" if _torch_version() < (2, 8) else "25"
    proc = run([str(script), cycles], timeout=150)
    assert proc.returncode == 0 and "cycles done" in proc.stdout, proc.stdout + proc.stderr


REINIT = """
import torch
import distkit.dist as dist

for world in range(5):
    rank, size = dist.init_dist()
    t = torch.tensor([float(rank + world)])
    dist.all_reduce(t)
    assert t.item() == 1 + 2 * world, (rank, world, t)
    dist.destroy_dist()
print("worlds done", flush=True)
"""


def test_a_script_makes_world_after_world_under_a_launcher(tmp_path):
    """A launcher's store outlives the worlds made on it: each world after the first
    read the one before's gloo addresses from it, and failed to connect about half the
    time (four worlds again: almost always)."""
    script = tmp_path / "reinit.py"
    script.write_text(REINIT)
    proc = run(["-m", "distkit", "launch", "-n", "2", str(script)], timeout=150)
    assert proc.stdout.count("worlds done") == 2, proc.stdout + proc.stderr


HELD = """
import os, sys, tempfile, torch, torch.distributed as td
import distkit.dist as dist
from distkit import _compat

path = os.path.join(tempfile.mkdtemp(), "store")
td.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
model = {"process_group": td.group.WORLD}  # what a DistributedDataParallel keeps
dist.all_reduce(torch.ones(2))
dist.destroy_dist()
# the group outlives destroy_dist: its backend must not die with it (joined with the GIL)
assert [bool(held) for _, held in _compat._lingering] == [True], _compat._lingering
del model  # the group goes; its backend stays held ...
assert len(_compat._lingering) == 1 and _compat._lingering[0][0]() is None
_compat._let_go()  # ... until distkit lets go of it, without the GIL
assert _compat._lingering == []
# at exit, a group still alive gets a moment without the GIL for its threads to finish
slept, sleep = [], _compat.time.sleep
_compat.time.sleep = slept.append
_compat._at_exit()
assert slept == [], slept  # none alive: no wait
td.init_process_group("gloo", init_method=f"file://{path}.2", rank=0, world_size=1)
_compat._at_exit()
assert slept == [_compat.SETTLE_SECONDS], slept
_compat.time.sleep = sleep
print("let go")
"""


def test_a_group_that_outlives_destroy_dist_keeps_its_backend_until_it_goes():
    # examples/train.py's DDP model held the world's group past destroy_dist: on torch
    # 2.4.1 one run in five then hung at exit, in ~ProcessGroupGloo joining a thread
    # that waited for the GIL (the loop above never met that order)
    assert run(["-c", HELD]).stdout.strip() == "let go"


FORKED = """
import os, sys, tempfile, time, torch, torch.distributed as td
import distkit.dist as dist

path = os.path.join(tempfile.mkdtemp(), "store")
td.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
dist.all_reduce(torch.ones(2))
dist.all_reduce(torch.ones(2), group=[0])  # a group distkit creates and caches
child = os.fork()
if child == 0:
    sys.exit(0)  # its exit hooks run, then the interpreter tears down
for _ in range(200):
    done, status = os.waitpid(child, os.WNOHANG)
    if done:
        print("child ended", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.05)
else:
    os.kill(child, 9)
    print("child hung")
"""


def test_a_forked_child_that_exits_does_not_wait_for_its_parents_threads():
    # a fork's child has none of its parent's threads: freeing an inherited gloo backend
    # at its exit waited for them for ever (a child that ends with os._exit, as
    # multiprocessing's do, never frees them)
    assert run(["-c", FORKED]).stdout.strip() == "child ended 0"


def test_buffers_distkit_makes_for_a_group_own_their_memory():
    """A tensor made by ``torch.frombuffer`` holds a Python object, and freeing it takes
    the GIL: when a gloo worker thread frees one as the interpreter exits, the process
    aborts after a run that succeeded (seen about once in forty 2-rank runs of
    examples/train.py on a busy machine before distkit stopped making them). distkit
    builds such buffers with ``owned_bytes``; ``torch.frombuffer`` is left only where
    the decoder hands a user a tensor over the receive buffer."""
    found = []
    for path in sorted((ROOT / "distkit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "frombuffer":
                if isinstance(node.value, ast.Name) and node.value.id == "torch":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(found) == 1 and found[0].startswith("distkit/dist/codec/wire.py:"), found

    raw = bytearray(b"distkit")
    t = owned_bytes(raw)
    raw[0] = ord("X")  # a copy: the source may change or go
    assert bytes(t.tolist()) == b"distkit" and t.dtype == torch.uint8
    assert owned_bytes(memoryview(b"ab")).tolist() == [97, 98]
    assert owned_bytes(b"").numel() == 0
