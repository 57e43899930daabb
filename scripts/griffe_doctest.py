"""A griffe extension for the docs site (mkdocs.yml): a docstring's ``>>>`` example renders as a
Python console code block. Markdown reads ``>>>`` as three nested quotes, so each run of
``>>>`` / ``...`` lines (and the output lines after them, up to a blank line) is fenced as
``pycon`` before mkdocstrings renders the docstring. Fenced examples are left as they are."""

from __future__ import annotations

import re
from typing import Any

import griffe

PROMPT = re.compile(r"^(?P<indent>[ \t]*)(?:>>>|\.\.\.)(?: |$)")
FENCE = re.compile(r"^[ \t]*(```|~~~)")


def fence_doctests(text: str) -> str:
    """``text`` with each doctest run outside a code fence fenced as ``pycon``."""
    out: list[str] = []
    lines = text.split("\n")
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else PROMPT.match(line)
        if m is None or not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = m.group("indent")
        block = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(lines[i][len(indent) :])
            i += 1
        if out and out[-1].strip():
            out.append("")
        out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
        if i < len(lines) and lines[i].strip():
            out.append("")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fences the doctest examples of every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
