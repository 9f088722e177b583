"""Docstrings match signatures, mmengine code keeps working, the documentation covers the API.

The documentation site (``mkdocs.yml``, ``docs/``, the README as its home page) builds with
``--strict`` and has an API reference entry for every public name.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import ROOT

import distkit
import distkit.dist as dist
import distkit.testing
import distkit.utils
from distkit.utils import environ

PUBLIC = sorted(
    {
        (module.__name__, name): getattr(module, name)
        for module in (dist, distkit.utils, environ, distkit.testing)
        for name in getattr(module, "__all__", None)
        or [n for n in vars(module) if not n.startswith("_")]
        if inspect.isfunction(getattr(module, name))
    }.items()
)


def documented_args(doc: str) -> list[str]:
    match = re.search(r"\n\s*Args:\n(.*?)(\n\s*\n|\Z)", doc, re.S)
    if not match:
        return []
    block = match.group(1)
    indent = min(len(line) - len(line.lstrip()) for line in block.splitlines() if line.strip())
    names = []
    for line in block.splitlines():
        if len(line) - len(line.lstrip()) == indent and ":" in line:
            names.append(line.strip().split(":")[0].lstrip("*"))
    return names


@pytest.mark.parametrize(("key", "fn"), PUBLIC, ids=[f"{m}.{n}" for (m, n), _ in PUBLIC])
def test_docstring_args_match_signature(key, fn):
    doc = inspect.getdoc(fn) or ""
    assert doc, f"{key} has no docstring"
    params = [p.name for p in inspect.signature(fn).parameters.values()]
    args = documented_args(doc)
    if params:
        assert args == params, f"{key}: docstring Args {args} != signature {params}"
    else:
        assert not args


def test_every_mmengine_dist_name_exists_with_a_compatible_signature():
    mm = pytest.importorskip("mmengine.dist")
    for name in mm.__all__:
        assert hasattr(dist, name), f"distkit.dist lacks mmengine.dist.{name}"
        theirs = inspect.signature(getattr(mm, name)).parameters
        ours = inspect.signature(getattr(dist, name)).parameters
        ours_list = list(ours.values())
        for i, p in enumerate(theirs.values()):
            if p.kind is p.VAR_KEYWORD:
                assert any(q.kind is q.VAR_KEYWORD for q in ours_list), name
                continue
            assert p.name in ours, f"{name}: mmengine's argument {p.name!r} is missing"
            if p.kind is p.POSITIONAL_OR_KEYWORD and not (name == "init_dist" and i == 2):
                # init_dist's third slot is timeout in distkit; a string there is taken as
                # mmengine's init_backend (see init_dist), checked below
                assert ours_list[i].name == p.name, f"{name}: argument {i} is not {p.name!r}"
        extra = [
            q
            for q in ours_list
            if q.name not in theirs and q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL)
        ]
        assert all(q.default is not q.empty for q in extra), f"{name}: new required argument"
    assert dist.init_dist("none", "gloo", "torch") == (0, 1)  # mmengine's positional form


def test_collectives_table_lists_every_public_function():
    table = (ROOT / "docs" / "collectives.md").read_text()
    missing = [
        n
        for n in dist.__all__
        if callable(getattr(dist, n)) and n[0].islower() and f"`{n}" not in table
    ]
    assert not missing, f"docs/collectives.md does not mention: {missing}"


def test_getting_started_quick_start_is_the_example_file():
    page = (ROOT / "docs" / "getting-started.md").read_text()
    block = re.search(r"## Quick start\n\n```python\n(.*?)```", page, re.S).group(1)
    assert block == (ROOT / "examples" / "quickstart.py").read_text()


def test_readme_is_a_landing_page_that_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    # .ci/run runs the bash block after this marker
    assert re.search(r"<!-- test-command -->\n```bash\n.*python -m pytest\n```", readme)
    pages = sorted(
        p.relative_to(ROOT).as_posix()
        for p in [*(ROOT / "docs").glob("*.md"), ROOT / "docs" / "api" / "index.md"]
        if p.name != "index.md" or p.parent.name == "api"
    )
    missing = [p for p in pages if f"]({p})" not in readme]
    assert not missing, f"README.md links to none of {missing}"


# -- the documentation site ------------------------------------------------------------


def public_names() -> dict[str, object]:
    """Every public name, dotted, with its object: the names a user can import."""
    modules = {
        "distkit": [n for n in distkit.__all__ if n not in ("dist", "utils", "__version__")],
        "distkit.dist": dist.__all__,
        "distkit.utils": distkit.utils.__all__,
        "distkit.utils.environ": [
            n
            for n, v in vars(environ).items()
            if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == environ.__name__
        ],
        "distkit.testing": distkit.testing.__all__,
    }
    module_objects = {"distkit": distkit, "distkit.dist": dist, "distkit.utils": distkit.utils}
    module_objects |= {"distkit.utils.environ": environ, "distkit.testing": distkit.testing}
    return {
        f"{module}.{name}": getattr(module_objects[module], name)
        for module, names in modules.items()
        for name in names
    }


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once with ``mkdocs build --strict``: (html by path, build output)."""
    pytest.importorskip("mkdocs", reason="pip install -e '.[test]' installs MkDocs")
    pytest.importorskip("material", reason="pip install -e '.[test]' installs mkdocs-material")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the [test] extra installs it")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    seconds = time.monotonic() - start
    html = {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*.html")}
    return html, proc, seconds


def test_the_site_builds_without_a_warning(site):
    _, proc, seconds = site
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    warnings = [line for line in log.splitlines() if re.match(r"\W*(WARNING|ERROR)", line)]
    assert not warnings, "\n".join(warnings)
    assert seconds < 120, f"the build took {seconds:.0f} s"


def test_the_api_reference_has_an_entry_for_every_public_name(site):
    html, _, _ = site
    ids = {i for page in html.values() for i in re.findall(r'id="(distkit[\w.]*)"', page)}
    # a name may be documented under another of its public paths: distkit.dist.get_group's
    # function is distkit.utils.get_group's, distkit.testing.RankError is distkit.RankError
    paths_of: dict[int, set[str]] = {}
    for path, value in public_names().items():
        paths_of.setdefault(id(value), set()).add(path)
    missing = [
        path
        for path, value in public_names().items()
        if path not in ids and not paths_of[id(value)] & ids
    ]
    assert not missing, f"no API reference entry for {missing}"


def test_the_api_reference_renders_docstrings_as_markdown(site):
    html, _, _ = site
    for path, page in html.items():
        if path.startswith("api/"):
            left = re.findall(r":(?:func|meth|class|data|attr|mod|exc):`", page)
            assert not left, f"{path} shows Sphinx roles: {left[:3]}"
            assert "::</p>" not in page, f"{path} shows a literal-block marker"


def test_the_home_page_is_the_readme(site):
    html, _, _ = site
    assert "Headline figures" in html["index.html"]
    assert "Working on distkit" in html["development.html"]  # CONTRIBUTING.md


@pytest.mark.parametrize("package", ["distkit", "distkit.dist", "distkit.utils"])
def test_each_package_lists_its_names_once_in_its_stub(package):
    import importlib
    import sys

    from distkit import _lazy

    module = importlib.import_module(package)
    # the stub read here with ast, not with the reader __all__ is built by
    path = ROOT / package.replace(".", "/") / "__init__.pyi"
    listed = [
        (alias.asname or alias.name, node.module)
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    ]
    names = [n for n, _ in listed]
    assert len(names) == len(set(names)), "a name is listed twice"
    assert sorted(names) == sorted(n for n in module.__all__ if n != "__version__")
    assert set(names) <= set(dir(module))
    stub = _lazy.read_stub(str(path))
    assert stub == dict(listed)
    for name, where in stub.items():
        value = getattr(module, name)
        # the stub tells type checkers where each name lives: it must be true
        source = sys.modules[where] if where != package else module
        assert getattr(source, name) is value, f"{package}.{name} is not {where}.{name}"
    # no other list of the names: the package's __init__.py holds none
    init = (ROOT / package.replace(".", "/") / "__init__.py").read_text()
    assert "_EXPORTS" not in init and "TYPE_CHECKING" not in init
