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


def test_cli_info_names_the_distribution():
    import distkit

    proc = cli("info")
    assert proc.returncode == 0, proc.stderr
    # the value starts with the name and version, so the table never folds them apart
    version = re.escape(distkit.__version__)
    assert re.search(rf"installed as[\s│|]+torch-distkit {version}(?![\w.])", proc.stdout)


class _Found:
    """What importlib.metadata finds: a version, and the files beside the metadata."""

    def __init__(self, version: str, files: dict[str, str]) -> None:
        self.version, self.files = version, files

    def read_text(self, name: str):
        return self.files.get(name)


EDITABLE = {
    "INSTALLER": "pip",
    "direct_url.json": '{"url": "file:///src", "dir_info": {"editable": true}}',
}


@pytest.mark.parametrize(
    "found, expected",
    [
        ([], "torch-distkit is not installed (distkit is imported from a source tree)"),
        # a build's egg-info in the source tree comes first on sys.path, the install after it
        ([("0.0.1", {}), ("{v}", EDITABLE)], "torch-distkit {v}, an editable install of /src"),
        ([("{v}", {"INSTALLER": "pip"})], "torch-distkit {v}"),
        (
            [("0.0.1", {"INSTALLER": "pip"})],
            "torch-distkit 0.0.1 (stale: the distkit imported is {v}; install it again)",
        ),
    ],
)
def test_installed_says_how_distkit_is_installed(found, expected, monkeypatch):
    from importlib import metadata

    import distkit
    from distkit.cli import installed

    v = distkit.__version__
    asked = []

    def distributions(name):
        asked.append(name)
        return iter([_Found(version.format(v=v), files) for version, files in found])

    monkeypatch.setattr(metadata, "distributions", distributions)
    assert installed() == expected.format(v=v)
    assert asked == ["torch-distkit"]
