"""The sdist and the wheel as a release builds them, from the files git tracks: the sdist
holds everything the tests, the examples and the benchmarks need (`python -m pytest` runs
in an unpacked sdist), the wheel holds the package alone, typed, under the distribution's
name. Built offline (`python -m build --no-isolation`, with the test extra's setuptools)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from conftest import ROOT

import distkit
from distkit.cli import DISTRIBUTION

#: What git tracks but a user of the sdist does not need: the repository's own tooling.
LEFT_OUT = (".ci/", ".gitignore")
#: The name setuptools gives the sdist's folder, the wheel's dist-info and the egg-info.
STEM = DISTRIBUTION.replace("-", "_")
HOME = "https://github.com/distkit-dev/distkit"


def _tracked() -> list[str]:
    """Every file git tracks, as it is on disk (a scratch file never added is no concern)."""
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True
        )
    except FileNotFoundError:
        top = None
    if top is None or top.returncode or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip("needs the git checkout, to know which files are tracked (not an sdist)")
    listed = subprocess.run(
        ["git", "ls-files", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (ROOT / name).is_file()})


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[list[str], Path, Path]:
    """``(tracked files, sdist, wheel)``, built from a copy of the tracked files only (no
    egg-info or build folder of an earlier build can add to them); the wheel is built from
    the sdist, as ``python -m build`` and pip do."""
    tracked = _tracked()
    tmp = tmp_path_factory.mktemp("packaging")
    source, out = tmp / "source", tmp / "out"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return tracked, sdist, wheel


def test_sdist_holds_every_tracked_file_and_nothing_else(built):
    tracked, sdist, _ = built
    top = f"{STEM}-{distkit.__version__}/"
    with tarfile.open(sdist) as tar:
        files = [m.name for m in tar.getmembers() if m.isfile()]
    assert all(name.startswith(top) for name in files), files
    shipped = {name[len(top) :] for name in files}
    expected = {name for name in tracked if not name.startswith(LEFT_OUT)}
    generated = {"PKG-INFO"} | {n for n in shipped if n.startswith(f"{STEM}.egg-info/")}
    assert sorted(expected - shipped) == [], "tracked but not in the sdist: add it to MANIFEST.in"
    assert sorted(shipped - expected - generated) == [], "in the sdist but not tracked"
    # what an unpacked sdist's test run needs beyond test_*.py (a list in the reader's eyes;
    # the comparison above already covers it)
    for name in ("tests/conftest.py", "tests/typing/user_code.py", "LICENSE", "CHANGELOG.md"):
        assert name in shipped, name
    assert {n for n in shipped if n.startswith("tests/helpers")}, "test helpers"
    for folder in ("examples/", "configs/", "benchmarks/", "docs/"):
        assert any(n.startswith(folder) for n in shipped), folder


def test_wheel_holds_the_typed_package_alone(built):
    tracked, _, wheel = built
    info = f"{STEM}-{distkit.__version__}.dist-info/"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        license_text = whl.read(f"{info}licenses/LICENSE")
    assert sorted(n for n in names if not n.startswith(("distkit/", info))) == []
    assert {n for n in names if n.startswith("distkit/")} == {
        n for n in tracked if n.startswith("distkit/")
    }
    typed = {n for n in names if n.endswith((".pyi", "/py.typed"))}
    assert typed == {
        "distkit/py.typed",
        "distkit/__init__.pyi",
        "distkit/dist/__init__.pyi",
        "distkit/utils/__init__.pyi",
    }
    assert license_text == (ROOT / "LICENSE").read_bytes()


def test_wheel_metadata_names_the_distribution_license_and_home(built):
    _, _, wheel = built
    info = f"{STEM}-{distkit.__version__}.dist-info/"
    with zipfile.ZipFile(wheel) as whl:
        meta = Parser().parsestr(whl.read(f"{info}METADATA").decode())
        entry_points = whl.read(f"{info}entry_points.txt").decode()
    assert (meta["Name"], meta["Version"]) == ("torch-distkit", distkit.__version__)
    assert "Apache-2.0" in (meta["License-Expression"] or meta["License"])
    assert meta.get_all("License-File") == ["LICENSE"]
    urls = dict(url.split(", ", 1) for url in meta.get_all("Project-URL"))
    assert urls == {
        "Homepage": HOME,
        "Documentation": "https://distkit-dev.github.io/distkit/",
        "Source": HOME,
        "Changelog": f"{HOME}/blob/main/CHANGELOG.md",
        "Issues": f"{HOME}/issues",
    }
    # the command and the pytest plugin keep their names
    assert "distkit = distkit.cli:main" in entry_points
    assert "distkit = distkit.testing.plugin" in entry_points


def test_the_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text


def test_changelog_describes_this_version_first():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[(\d[^\]]*)\] - (\d{4}-\d{2}-\d{2})$", changelog, re.M)
    assert versions, "no '## [version] - date' heading"
    assert versions[0][0] == distkit.__version__
    assert versions == sorted(versions, key=lambda v: v[1], reverse=True), "newest first"
