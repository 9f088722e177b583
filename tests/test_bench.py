"""The benchmark harness runs end to end (a smoke test of its plumbing, not of timings)."""

from __future__ import annotations

import json

from helpers_subprocess import run


def test_benchmark_quick_run_reports_every_case(tmp_path):
    out = tmp_path / "bench.json"
    proc = run(
        [
            "benchmarks/run.py",
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
    for row in data["rows"]:
        assert row["seconds"]["distkit"] > 0
        assert len(row["seconds"]) >= 2, "every case is measured against a peer"
    assert any(n.startswith("serial floor of broadcast_object_list") for n in names)
    noop = {r["case"]: r for r in data["noop"]}
    assert set(noop) >= {"get_rank()", "all_reduce(t)", "all_gather_object(t)"}
    for row in noop.values():  # both controls, each a real measurement
        assert row["identity_ns"] > 0 and row["same_args_ns"] > 0, row
    assert "torch/distkit" in proc.stdout and "single process" in proc.stdout
