"""Tearing worlds down never deadlocks, on every torch distkit supports.

On torch before 2.8, destroying a gloo group can deadlock: ``~ProcessGroup`` joins gloo's
worker threads while holding the GIL, and a worker may be freeing a tensor, which needs
the GIL. ``distkit._compat.destroy`` avoids it by letting the group go before its backend.
Without that, this loop hung within its first 150 cycles on torch 2.4.1 (every run); on
torch 2.8 and newer it checks that nothing else broke.
"""

from __future__ import annotations

from helpers_subprocess import run

LOOP = """
import os, sys, tempfile, torch, torch.distributed as td
import distkit.dist as dist
from torch.multiprocessing import spawn

def body(rank, path, n):
    for i in range(n):
        td.init_process_group("gloo", init_method=f"file://{path}.{i}", rank=rank, world_size=2)
        shards = dist.all_gather(torch.arange(rank + 1.0))
        dist.all_reduce(torch.tensor(float(rank)), op="mean")
        dist.gather_object({"rank": rank, "sizes": [len(s) for s in shards]})
        dist.all_gather_object([torch.ones(3)])
        dist.destroy_dist()

if __name__ == "__main__":
    spawn(body, args=(os.path.join(tempfile.mkdtemp(), "store"), int(sys.argv[1])), nprocs=2)
    print("cycles done")
"""


def test_destroying_worlds_in_a_loop_never_deadlocks(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    proc = run([str(script), "100"], timeout=150)
    assert proc.returncode == 0 and "cycles done" in proc.stdout, proc.stdout + proc.stderr
