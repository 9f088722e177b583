"""A griffe extension for the API reference: Sphinx roles in docstrings become Markdown.

distkit's docstrings name other objects with Sphinx roles (``:func:`send```,
``:data:`~distkit.dist.GroupLike```) and introduce literal blocks with ``::``, as
torch's and mmengine's do. mkdocstrings renders Markdown, so this extension rewrites
them: a role that names an object of the API reference becomes a link to its entry,
any other role plain code; a paragraph ending in ``::`` ends in ``:`` (its indented
block renders as code either way).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:func|meth|class|data|attr|mod|obj|exc|const):`(~?)([\w.]+)(?:\(\))?`"
)
API = Path(__file__).parent / "api"


def documented() -> dict[str, str]:
    """Each name of the API reference (full and short) mapped to the entry's identifier."""
    names: dict[str, str] = {}
    short: dict[str, set[str]] = {}
    for page in sorted(API.glob("*.md")):
        for ident in re.findall(r"^::: ([\w.]+)", page.read_text(encoding="utf-8"), re.M):
            names[ident] = ident
            short.setdefault(ident.rsplit(".", 1)[-1], set()).add(ident)
    for name, idents in short.items():
        if len(idents) == 1:  # a short name is a link only where it is unambiguous
            names.setdefault(name, idents.pop())
    return names


class SphinxRoles(griffe.Extension):
    def __init__(self) -> None:
        self.names = documented()

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None:
            docstring.value = self.rewrite(docstring.value)

    def rewrite(self, text: str) -> str:
        def role(match: re.Match[str]) -> str:
            tilde, target = match.groups()
            shown = target.rsplit(".", 1)[-1] if tilde else target
            ident = self.names.get(target) or self.names.get(target.removeprefix("distkit."))
            return f"[`{shown}`][{ident}]" if ident else f"`{shown}`"

        text = ROLE.sub(role, text)
        return re.sub(r"(\S)::$", r"\1:", text, flags=re.M)
