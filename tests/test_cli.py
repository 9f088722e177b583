"""The ``distkit`` command line as a person meets it: help, version, a missing script,
and ``distkit bench --quick`` as a smoke test."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import ROOT
from helpers_subprocess import script_env


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distkit", *args],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_without_arguments_prints_the_help():
    proc = cli()
    assert proc.returncode == 0, proc.stderr
    assert (
        "usage: distkit" in proc.stdout and "launch" in proc.stdout and "examples:" in proc.stdout
    )


def test_cli_version():
    import distkit

    proc = cli("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"distkit {distkit.__version__}")


def test_cli_help_is_written_for_people():
    for args in (("--help",), ("launch", "--help")):
        proc = cli(*args)
        assert proc.returncode == 0 and "``" not in proc.stdout, proc.stdout
        assert "==SUPPRESS==" not in proc.stdout


@pytest.mark.parametrize("target", [["missing.py"], ["-m", "no_such_package.train"]])
def test_cli_missing_script_is_one_clear_error(target, tmp_path):
    proc = cli("launch", "-n", "2", *target)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "distkit launch: no such script: missing.py"
        if target == ["missing.py"]
        else "distkit launch: no module named no_such_package.train"
    ]


def test_cli_bench_quick_is_a_smoke_test():
    start = time.monotonic()
    proc = cli("bench", "--quick", timeout=300)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert "all_gather_object" in proc.stdout and "get_rank()" in proc.stdout
    # about 15 s on a quiet 2-core machine (it took over 2 minutes); room for a busy one
    assert took < 45, f"bench --quick took {took:.0f} s"
