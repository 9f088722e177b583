"""The example scripts end to end (slow, and still run by .ci/run)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from helpers_subprocess import finish, free_port, run, script_env, start

pytestmark = pytest.mark.slow

EPOCHS = "train.epochs=3"  # the resume test kills a run in its last epoch


def metrics(work_dir) -> dict:
    with open(os.path.join(work_dir, "metrics.json")) as f:
        return json.load(f)


def assert_same_run(a: dict, b: dict) -> None:
    assert len(a["epochs"]) == len(b["epochs"]) > 0
    for x, y in zip(a["epochs"], b["epochs"]):
        assert abs(x["train_loss"] - y["train_loss"]) <= 1e-4 * abs(x["train_loss"]), (x, y)
        assert abs(x["val_accuracy"] - y["val_accuracy"]) <= 1e-4 * x["val_accuracy"], (x, y)
        assert x["val_samples"] == y["val_samples"] == 1001


def test_same_results_on_one_rank_two_ranks_and_two_nodes(tmp_path):
    one, two, nodes = (str(tmp_path / n) for n in ("one", "two", "nodes"))
    # the three runs at once: independent, and each mostly waits on its ranks
    port = free_port()
    procs = [
        start(["examples/train.py", "--work-dir", one, "--cfg-options", EPOCHS]),
        start(
            [
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "examples/train.py",
                "--work-dir",
                two,
                "--cfg-options",
                EPOCHS,
            ]
        ),
    ]
    procs += [
        start(
            [
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "examples/train.py",
                "--work-dir",
                nodes,
                "--cfg-options",
                EPOCHS,
            ]
        )
        for node in (0, 1)
    ]
    for proc in procs:
        finish(proc)
    single, double, simulated = metrics(one), metrics(two), metrics(nodes)
    assert (single["world_size"], double["world_size"], simulated["world_size"]) == (1, 2, 2)
    assert_same_run(single, double)
    assert_same_run(single, simulated)
    assert single["epochs"][-1]["val_accuracy"] > 0.6  # it learns


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    work = tmp_path_factory.mktemp("trained")
    run(["examples/train.py", "--work-dir", str(work), "--cfg-options", "train.epochs=2"])
    return str(work / "latest.pth")


def test_eval_counts_every_sample_once_on_one_two_and_three_ranks(checkpoint, tmp_path):
    # the three runs at once: independent, and each mostly waits on its ranks
    outs = [str(tmp_path / f"eval{nproc}.json") for nproc in (1, 2, 3)]
    procs = [start(["examples/eval.py", "--checkpoint", checkpoint, "--out", outs[0]])]
    procs += [
        start(
            [
                *("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"),
                *("examples/eval.py", "--checkpoint", checkpoint, "--out", out),
            ]
        )
        for nproc, out in ((2, outs[1]), (3, outs[2]))
    ]
    results = []
    for proc, out in zip(procs, outs):
        finish(proc)
        with open(out) as f:
            results.append(json.load(f))
    for nproc, r in zip((1, 2, 3), results):
        assert r["world_size"] == nproc and r["dataset_size"] == 1001
        assert r["samples"] == r["unique_samples"] == 1001 and r["in_order"]
    assert results[0]["accuracy"] == results[1]["accuracy"] == results[2]["accuracy"]


def test_eval_shuffled_and_streamed_report_the_same_metric(checkpoint, tmp_path):
    """``--shuffle`` (sampler= restores the order) and ``--stream`` (iter_results writes
    the predictions to a file) print the very metric of the plain run, on 2 ranks."""
    modes = {
        "plain": [],
        "shuffle": ["--shuffle"],
        "stream": ["--stream", str(tmp_path / "stream.jsonl")],
        "both": ["--shuffle", "--stream", str(tmp_path / "both.jsonl")],
    }
    printed, results = {}, {}
    cmd = ["-m", "distkit", "launch", "-n", "2", "examples/eval.py", "--checkpoint", checkpoint]
    procs = {  # the four runs at once, as above
        name: start([*cmd, "--out", str(tmp_path / f"{name}.json"), *options])
        for name, options in modes.items()
    }
    for name, proc in procs.items():
        stdout = finish(proc)
        printed[name] = [line for line in stdout.splitlines() if "accuracy" in line]
        with open(tmp_path / f"{name}.json") as f:
            results[name] = json.load(f)
    assert len(printed["plain"]) == 1 and "on 2 rank(s)" in printed["plain"][0]
    for name in modes:
        assert printed[name] == printed["plain"], name
        r = results[name]
        assert r["samples"] == r["unique_samples"] == 1001 and r["in_order"], name
        assert r["accuracy"] == results["plain"]["accuracy"], name
    for name in ("stream", "both"):
        with open(tmp_path / f"{name}.jsonl") as f:
            lines = [json.loads(line) for line in f]
        assert [x["index"] for x in lines] == list(range(1001))
        correct = sum(x["prediction"] == x["target"] for x in lines)
        assert correct / 1001 == results["plain"]["accuracy"]


def launch_train(work_dir: str, *options: str) -> list[str]:
    """``python -m distkit launch -n 2 examples/train.py`` into ``work_dir``."""
    return [
        "-m",
        "distkit",
        "launch",
        "-n",
        "2",
        "examples/train.py",
        "--work-dir",
        work_dir,
        *options,
    ]


def test_resume_after_killing_training_mid_epoch(tmp_path):
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    run(launch_train(full, "--cfg-options", EPOCHS))
    # the same run, slowed down (50 ms per step, over a second per epoch) so it can be
    # killed in its third epoch: at once when epoch 2's metrics appear (written after its
    # checkpoint), which leaves room for a test process starved by a loaded machine
    proc = start(launch_train(killed, "--cfg-options", EPOCHS, "train.step_delay=0.05"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = os.path.exists(os.path.join(killed, "metrics.json"))
        if done and len(metrics(killed)["epochs"]) >= 2:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # the launcher; its ranks die with it
    proc.wait(timeout=30)
    assert len(metrics(killed)["epochs"]) == 2, "the kill must land mid-run, after epoch 2"
    out = run(launch_train(killed, "--resume", "--cfg-options", EPOCHS)).stdout
    assert "resumed from" in out and "after epoch 2" in out
    assert_same_run(metrics(full), metrics(killed))


PROBE = """
import json, os, torch
import distkit.dist as dist
launcher = os.environ["PROBE_LAUNCHER"]
inferred = dist.infer_launcher()  # before init_dist, which exports torchrun's variables
rank, world = dist.init_dist(launcher)
out = {"rank": rank, "world": world, "inferred": inferred,
       "local": [dist.get_local_rank(), dist.get_local_size()],
       "master": os.environ["MASTER_ADDR"], "sum": dist.all_reduce(torch.ones(1)).item()}
print(json.dumps(out))
dist.destroy_dist()
"""


def slurm_env(rank: int, port: int) -> dict:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(rank),
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "42",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "127.0.0.[1]",
        "SLURM_TASKS_PER_NODE": "2",
        "MASTER_PORT": str(port),
        "PATH": os.environ["PATH"] + ":/nonexistent",
    }


def mpi_env(rank: int, port: int) -> dict:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_PORT": str(port),
    }


@pytest.mark.parametrize("launcher", ["slurm", "mpi"])
@pytest.mark.parametrize("how", ["named", "auto"])
def test_init_dist_from_slurm_and_mpi_variables(launcher, how):
    port = free_port()
    make_env = slurm_env if launcher == "slurm" else mpi_env
    procs = [
        start(
            ["-c", PROBE],
            PROBE_LAUNCHER=launcher if how == "named" else "auto",
            **make_env(rank, port),
        )
        for rank in (0, 1)
    ]
    outs = [json.loads(finish(p).strip().splitlines()[-1]) for p in procs]
    for rank, out in enumerate(outs):
        assert out == {
            "rank": rank,
            "world": 2,
            "inferred": launcher,
            "local": [rank, 2],
            "master": "127.0.0.1",
            "sum": 2.0,
        }


def _netns_available() -> str:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip netns)"
    probe = subprocess.run(
        ["ip", "netns", "add", f"distkit-probe-{os.getpid()}"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"ip netns add failed here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"distkit-probe-{os.getpid()}"], check=False)
    return ""


def test_two_nodes_in_two_network_namespaces(tmp_path):
    reason = _netns_available()
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 10000
    names = [f"dk{tag}a", f"dk{tag}b"]
    links = [f"vdk{tag}a", f"vdk{tag}b"]
    addrs = ["10.231.7.1", "10.231.7.2"]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        for ns in names:
            ip("netns", "add", ns)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(names, links, addrs):
            ip("link", "set", link, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            ip("-n", ns, "link", "set", link, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        out = str(tmp_path / "netns")
        procs = []
        for node, (ns, link) in enumerate(zip(names, links)):
            # the namespaces are this run's own, so a fixed port inside them is private
            cmd = [
                "ip",
                "netns",
                "exec",
                ns,
                "env",
                f"GLOO_SOCKET_IFNAME={link}",
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                f"--master-addr={addrs[0]}",
                "--master-port=29511",
                "examples/train.py",
                "--work-dir",
                out,
                "--cfg-options",
                "train.epochs=2",
            ]
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=script_env(),
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        for proc in procs:
            finish(proc, timeout=240)
        result = metrics(out)
        assert result["world_size"] == 2 and len(result["epochs"]) == 2
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
