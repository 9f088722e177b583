"""The ``distkit`` command line as a person meets it: help, version, a missing script
(``distkit bench --quick`` is run by tests/test_bench.py)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

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
    from distkit.cli import _parsers

    top, launch = cli("--help"), cli("launch", "--help")
    for proc, parser in zip((top, launch), _parsers()):
        assert proc.returncode == 0, proc.stderr
        for jargon in ("``", ":func:", ":class:", "==SUPPRESS==", "%(default)"):
            assert jargon not in proc.stdout, (jargon, proc.stdout)
        # every option is shown with words after it, not only its name
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue  # the commands: checked below
            assert action.help, f"{action.option_strings or action.dest} has no help"
            for flag in action.option_strings:
                assert flag in proc.stdout, flag
    # each command says what it does and has an example; launch spells out its exit codes
    for command in ("info", "launch", "bench"):
        assert re.search(rf"^ +{command} +[a-z]", top.stdout, re.M), command
        assert re.search(rf"^ +distkit {command}\b", top.stdout, re.M), command
    for status in ("0 every rank succeeded", "1 a rank failed", "2 bad usage", "130 Ctrl-C"):
        assert status in " ".join(launch.stdout.split()), status


@pytest.mark.parametrize("target", [["missing.py"], ["-m", "no_such_package.train"]])
def test_cli_missing_script_is_one_clear_error(target, tmp_path):
    proc = cli("launch", "-n", "2", *target)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "distkit launch: no such script: missing.py"
        if target == ["missing.py"]
        else "distkit launch: no module named no_such_package.train"
    ]
