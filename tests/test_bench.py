"""The benchmark harness runs end to end (a smoke test of its plumbing, not of timings)."""

from __future__ import annotations

import importlib.util
import json
import os

from conftest import ROOT
from helpers_subprocess import run

from distkit import scale_bench, scale_model


def test_benchmark_quick_run_reports_every_case(tmp_path):
    # through the command line users type (``benchmarks/run.py`` calls the same main)
    out = tmp_path / "bench.json"
    proc = run(
        [
            "-m",
            "distkit",
            "bench",
            "--quick",
            "--budget",
            "0.01",
            "--timeout",
            "300",
            "--json",
            str(out),
        ],
        timeout=600,
    )
    data = json.loads(out.read_text())
    names = [row["case"]["name"] for row in data["rows"]]
    for op in ("all_gather_object", "broadcast_object_list", "gather_object"):
        assert sum(n.startswith(op) for n in names) == 5, names  # 5 payloads each
    assert any(n.startswith("collect_results") for n in names)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert any(n.startswith(f"{op}: 1 MiB") for n in names)
    p2p = [n for n in names if n.startswith(("recv:", "ring exchange"))]
    # 2 tensor sizes (1 MiB also against a new tensor per message), an object, a ring,
    # the receiver's memory
    assert len(p2p) == 6, p2p
    for row in data["rows"]:
        if row["case"]["check"] == "memory":  # peak bytes, each in a world of its own
            assert row["bytes"]["distkit"] > 0 and row["payload"] > 0, row
            continue
        assert row["seconds"]["distkit"] > 0
        assert len(row["seconds"]) >= 2, "every case is measured against a peer"
    assert any(n.startswith("serial floor of broadcast_object_list") for n in names)
    noop = {r["case"]: r for r in data["noop"]}
    assert set(noop) >= {"get_rank()", "all_reduce(t)", "all_gather_object(t)"}
    for row in noop.values():  # both controls, each a real measurement
        assert row["identity_ns"] > 0 and row["same_args_ns"] > 0, row
    assert "torch/distkit" in proc.stdout and "single process" in proc.stdout
    assert "all_gather_object" in proc.stdout and "get_rank()" in proc.stdout


def test_benchmark_runs_without_numpy_and_says_which_columns_need_it(tmp_path):
    # NumPy is no dependency of distkit: hide it (a package that fails to import, as a
    # missing one does) from the bench and from its ranks, which inherit PYTHONPATH
    hidden = tmp_path / "hidden" / "numpy"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        'raise ModuleNotFoundError("numpy is hidden by the test", name="numpy")\n'
    )
    out = tmp_path / "bench.json"
    proc = run(
        [
            "benchmarks/run.py",
            "--only",
            "objects,tensors",
            "--quick",
            "--budget",
            "0.01",
            "--timeout",
            "300",
            "--json",
            str(out),
        ],
        timeout=600,
        PYTHONPATH=os.pathsep.join([str(hidden.parent), str(ROOT)]),
    )
    rows = json.loads(out.read_text())["rows"]
    mmengine = importlib.util.find_spec("mmengine") is not None
    objects = [row for row in rows if row["case"]["group"] == "objects"]
    assert len(objects) == 16, [row["case"]["name"] for row in objects]  # 5 payloads x 3, floor
    for row in objects:  # torch's object collectives call tensor.numpy()
        assert row["seconds"]["distkit"] > 0 and "torch" not in row["seconds"], row
        assert row["missing"]["torch"] == "needs NumPy", row
    for row in rows:  # mmengine imports NumPy
        assert not any(name.startswith("mmengine") for name in row.get("seconds", ())), row
        if mmengine and any(name.startswith("mmengine") for name in row["missing"]):
            assert set(row["missing"].values()) == {"needs NumPy"}, row
    if mmengine:
        assert objects[0]["missing"]["mmengine"] == "needs NumPy"
    tensors = [row for row in rows if row["case"]["group"] in ("tensors", "uneven")]
    assert tensors and all(row["seconds"]["torch"] > 0 for row in tensors)  # no NumPy needed
    assert "n/a (needs NumPy)" in proc.stdout


def test_scale_bench_quick_run_prints_real_rows_and_the_model(tmp_path):
    out = tmp_path / "scale.json"
    proc = run(
        [
            "-m",
            "distkit",
            "bench",
            "--only",
            "scale",
            "--quick",
            "--ranks",
            "2",
            "--payload-mib",
            "4",
            "--timeout",
            "120",
            "--json",
            str(out),
        ],
        timeout=180,
    )
    rows = {row["op"]: row for row in json.loads(out.read_text())["scale"]}
    assert set(rows) == set(scale_model.OPS), sorted(rows)
    for row in rows.values():
        assert row["world"] == 2 and len(row["sizes"]) == 2, row
        for impl in ("distkit", "torch"):  # each a measurement, not a placeholder
            assert row["seconds"][impl] > 0 and row["memory"][impl] >= 0, row
    # torch pads the tiny rank's pickle to the large one and holds the rows twice
    gathered = rows["all_gather_object"]["memory"]
    assert 0 < gathered["distkit"] < gathered["torch"] / 2, gathered
    assert "model against the measurement" in proc.stdout
    assert "1024 ranks" in proc.stdout


def test_scale_model_agrees_with_a_measured_row():
    """The cost model (distkit/scale_model.py) against a cheap measurement: if distkit's
    object collectives start holding more (or less) memory, the model must change too."""
    objects = ("all_gather_object", "gather_object", "broadcast_object_list")
    rows = scale_bench.run([2], 8 * scale_bench.MiB, 1, timeout=120, ops=objects)
    assert [row["op"] for row in rows] == list(objects)
    for row in rows:
        for impl in ("distkit", "torch"):
            got = row["memory"][impl]
            want = scale_model.cost(row["op"], impl, row["sizes"], row["root"]).memory
            assert scale_model.agrees(want, got), (row["case"], impl, want, got)
