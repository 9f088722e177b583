"""distkit.launch, `distkit launch` and `distkit info`: results, failures, no orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT
from helpers_subprocess import alive, run, script_env

import distkit
import distkit.dist as dist
from distkit.testing import ranks


def rank_square() -> int:
    return dist.get_rank() ** 2


def test_launch_returns_each_rank_value():
    assert distkit.launch(rank_square, 3) == [0, 1, 4]
    factor = 5  # a closure, a lambda: the ranks are forked, nothing is pickled
    out = distkit.launch(lambda: dist.all_reduce(torch.ones(1) * factor).item(), 2)
    assert out == [10.0, 10.0]
    assert distkit.launch(pow, 2, args=(2,), kwargs={"exp": 3}) == [8, 8]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_launch_other_start_methods(method):
    assert distkit.launch(rank_square, 2, start_method=method) == [0, 1]


@ranks(1)
def test_launch_refuses_to_fork_ranks_from_a_process_with_a_process_group():
    # the forked ranks inherited the group and failed in torch's init_process_group
    # ("trying to initialize the default process group twice!")
    with pytest.raises(ValueError, match="start_method='fork' in a process that has a process"):
        distkit.launch(rank_square, 2, start_method="fork")


def threads() -> tuple[int, object]:
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_launch_gives_each_rank_one_thread_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    here = torch.get_num_threads()
    assert distkit.launch(threads, 2) == [(1, "1")] * 2  # as torchrun: ranks share cores
    assert distkit.launch(threads, 1) == [(here, None)]  # one rank has the cores to itself
    # a choice made by the caller stands (torch, already loaded, keeps its pool)
    assert distkit.launch(threads, 2, env={"OMP_NUM_THREADS": "2"}) == [(here, "2")] * 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # torch reads it at import (capped at the cores)
    for n, value in distkit.launch(threads, 2, start_method="spawn"):
        assert value == "3" and (n > 1 or here == 1)


def record_pid_then(fail: str, folder: str) -> None:
    rank = dist.get_rank()
    with open(os.path.join(folder, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    if rank == 1:
        if fail == "raise":
            raise KeyError("no such key on rank 1")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here, mid-collective
    time.sleep(60)


def pids(folder) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("pid-*"))]


@pytest.mark.parametrize("fail", ["raise", "sigkill"])
def test_a_failing_rank_stops_the_others_and_leaves_no_process(fail, tmp_path):
    start = time.monotonic()
    with pytest.raises(distkit.RankError) as info:
        distkit.launch(record_pid_then, 2, args=(fail, str(tmp_path)), timeout=30)
    assert time.monotonic() - start < 15, "must end within a few seconds, not the timeout"
    text = str(info.value)
    if fail == "raise":
        assert "failed on rank(s) 1" in text or "rank 1 first" in text
        assert "KeyError: 'no such key on rank 1'" in text and "record_pid_then" in text
        original = info.value.failures[1].rebuild()  # the exception object itself
        assert isinstance(original, KeyError) and original.args == ("no such key on rank 1",)
    else:
        assert "rank 1 died (killed by signal 9)" in text
    launched = pids(tmp_path)
    assert len(launched) == 2
    assert not any(alive(pid) for pid in launched), "a rank outlived launch()"


def hangs() -> None:
    if dist.get_rank() == 0:
        time.sleep(60)


def test_launch_timeout_shows_where_ranks_hang():
    start = time.monotonic()
    # 5 s: room for rank 1 to return on a loaded machine (with 2 s it sometimes had not)
    with pytest.raises(distkit.RankTimeout, match="did not finish within 5 s on rank") as info:
        distkit.launch(hangs, 2, timeout=5)
    assert time.monotonic() - start < 30  # not the 60 s rank 0 sleeps
    message = str(info.value)
    assert "on rank(s) 0 of 2" in message, message  # rank 1 returned: it hangs nowhere
    # rank 0's stack, innermost call first: the function it hangs in, in this file
    stack = message.split("--- rank 0 was here (all threads) ---\n", 1)[1]
    innermost = stack.splitlines()[1]
    assert re.search(r'File ".*test_launcher\.py", line \d+ in hangs$', innermost), message
    assert "--- rank 1 was here" not in message, message


def test_launch_argument_errors():
    with pytest.raises(ValueError, match="nprocs must be an int >= 1"):
        distkit.launch(rank_square, 0)
    with pytest.raises(TypeError, match="fn must be callable"):
        distkit.launch("rank_square", 2)


def test_launch_from_an_interactive_session():
    code = (
        "import distkit, distkit.dist as dist\n"
        "def typed_in_a_repl(x):\n"
        "    return dist.all_gather_object(dist.get_rank() * x)\n"
        "\n"  # a blank line ends the block, as at a real prompt
        "print(distkit.launch(typed_in_a_repl, 3, args=(7,)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-i"],
        input=code,
        capture_output=True,
        text=True,
        env=script_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert "[[0, 7, 14], [0, 7, 14], [0, 7, 14]]" in proc.stdout, proc.stderr


def test_import_of_dist_does_not_import_torch():
    code = "import sys, distkit.dist as dist; print(dist.get_rank(), 'torch' in sys.modules)"
    assert run(["-c", code]).stdout.split() == ["0", "False"]
    code = "import sys, distkit; distkit.print('hi'); print('torch' in sys.modules)"
    assert run(["-c", code]).stdout.split() == ["hi", "False"]


def test_collectives_do_not_import_the_compiler_until_torch_compile_does():
    # torch._dynamo costs 70 to 170 MB and about a second to import: only code that
    # compiles should pay for it, and distkit's graph breaks must still be ready then
    code = (
        "import sys, torch, distkit, distkit.dist as dist\n"
        "def step():\n"
        "    dist.all_reduce(torch.ones(1), op='max'); dist.all_gather_object({'a': 1})\n"
        "    return 'torch._dynamo' in sys.modules\n"
        "print(step(), distkit.launch(step, nprocs=2, timeout=120))\n"
        "import torch._dynamo\n"
        "from distkit.dist import _route\n"
        "print(sorted(_route._EAGER) == sorted(_route._EAGER_METHODS))\n"
    )
    assert run(["-c", code]).stdout.split() == ["False", "[False,", "False]", "True"]


# -- the command line ------------------------------------------------------------------------


def test_cli_launch_runs_a_script_on_n_ranks():
    # with ResourceWarning shown: a rank leaves none of its pipes to the launcher unclosed
    proc = run(
        ["-m", "distkit", "launch", "-n", "2", "examples/quickstart.py"],
        PYTHONWARNINGS="default::ResourceWarning",
    )
    assert "world=2 mean loss=0.50" in proc.stdout
    assert "ResourceWarning" not in proc.stderr, proc.stderr


FAILING = """
import torch
import distkit.dist as dist
dist.init_dist()
if dist.get_rank() == 1:
    raise ValueError("rank one is unhappy")
dist.all_reduce(torch.ones(1))
"""


def test_cli_launch_reports_the_failing_rank(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILING)
    proc = subprocess.run(
        [sys.executable, "-m", "distkit", "launch", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        # room for rank 1's own exit: on a loaded machine torch's teardown at exit can
        # outlast the launcher's 3 s before it stops the ranks, and its "how" would vary
        env=script_env(DISTKIT_STOP_GRACE="60"),
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "distkit launch: rank 1 of 2 failed first (exit code 1)" in proc.stderr, proc.stderr
    assert 'fails.py", line 6' in proc.stderr and "ValueError: rank one is unhappy" in proc.stderr


def test_cli_info_explains_the_launcher():
    out = run(["-m", "distkit", "info"]).stdout
    assert "torch" in out and "gloo" in out and "available" in out
    assert "none: no launcher variables are set" in out
    slurm = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_NODELIST": "gpu[07-08]",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_NODEID": "0",
    }
    out = run(["-m", "distkit", "info"], **slurm).stdout
    assert "slurm: SLURM_PROCID, SLURM_NTASKS=4 and SLURM_STEP_ID" in out
    assert "gpu07:29500" in out and "0 of 4" in out


def test_cli_bench_is_wired():
    out = run(["-m", "distkit", "bench", "--only", "noop", "--quick"]).stdout
    assert "single process" in out and "get_rank()" in out
