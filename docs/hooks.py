"""mkdocs hooks: the pages that come from the repository's top-level documents.

The README is the landing page on GitHub and on PyPI; on the site it is the home page
(``index.md``), its links into ``docs/`` made relative to the site. ``CONTRIBUTING.md``
is shown inside the Development page, where its marker comment stands. On GitHub both
files read as they are, links included.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

CONTRIBUTING_MARKER = (
    "<!-- CONTRIBUTING.md is placed here when the site is built (docs/hooks.py) -->"
)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    root = Path(config["config_file_path"]).parent
    if page.file.src_uri == "index.md":
        text = (root / "README.md").read_text(encoding="utf-8")
        text = re.sub(r"\]\(docs/", "](", text)
        text = text.replace("](CONTRIBUTING.md)", "](development.md#working-on-distkit)")
        # the other top-level files are not pages of the site: link them in the repository
        blob = config["repo_url"].rstrip("/") + "/blob/main/"
        return re.sub(r"\]\((CHANGELOG\.md|LICENSE)\)", lambda m: f"]({blob}{m[1]})", text)
    if CONTRIBUTING_MARKER in markdown:
        contributing = (root / "CONTRIBUTING.md").read_text(encoding="utf-8")
        contributing = _one_level_down(contributing)
        markdown = markdown.replace(CONTRIBUTING_MARKER, contributing)
        return markdown.replace("](../CONTRIBUTING.md)", "](#working-on-distkit)")
    return markdown


def _one_level_down(markdown: str) -> str:
    """Demote every heading one level (its title becomes a section), code blocks untouched."""
    lines, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            line = "#" + line
        lines.append(line)
    return "".join(lines)
