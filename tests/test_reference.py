"""The generated reference shows everything a user looks up: the engines' signatures with every
parameter and its default, every field of ``SaveStats``, of the option classes and of the
retention policies, each with its own description; and a docstring's ``>>>`` example renders
as code, not as nested quotes. Built with the site (``mkdocs build``), read from its HTML."""

from __future__ import annotations

import dataclasses
import html
import inspect
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from snippets import env

import asyncckpt

REPO = Path(__file__).resolve().parents[1]

#: The classes whose every field the reference shows, by the page that shows them.
FIELDS = {
    "api": ["SaveStats", "KeepLast", "KeepBest", "KeepEvery", "KeepInterval", "KeepSteps"],
    "options": [
        "Schedule", "Retention", "Distributed", "Preemption", "ObjectStore", "MemoryTier",
        "Staging",
    ],
}  # fmt: skip
#: The engines, whose every parameter (with its default) the API page shows.
ENGINES = ["CheckpointEngine", "SyncCheckpointEngine"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return out


class Page(HTMLParser):
    """A built page: the text of each element by its ``id``, of each ``<pre>``, and the
    text found inside a ``<blockquote>``."""

    VOID = {"area", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[tuple[str, str | None]] = []
        self.ids: dict[str, list[str]] = {}
        self.pres: list[list[str]] = []
        self.quoted: list[str] = []
        self.quote_depth = 0
        self.max_quote_depth = 0
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.VOID:
            return
        ident = dict(attrs).get("id")
        self.open.append((tag, ident))
        if ident:
            self.ids.setdefault(ident, [])
        if tag == "pre":
            self.pres.append([])
        if tag == "blockquote":
            self.quote_depth += 1
            self.max_quote_depth = max(self.max_quote_depth, self.quote_depth)

    def handle_endtag(self, tag: str) -> None:
        if tag not in {t for t, _ in self.open}:
            return
        while True:
            t, _ = self.open.pop()
            if t == "blockquote":
                self.quote_depth -= 1
            if t == tag:
                return

    def handle_data(self, data: str) -> None:
        for _, ident in self.open:
            if ident:
                self.ids[ident].append(data)
        if any(t == "pre" for t, _ in self.open):
            self.pres[-1].append(data)
        if self.quote_depth:
            self.quoted.append(data)

    def text(self, ident: str) -> str:
        return "".join(self.ids.get(ident, []))

    def code_blocks(self) -> list[str]:
        return ["".join(p) for p in self.pres]


def page(site: Path, name: str) -> Page:
    return Page((site / "reference" / name / "index.html").read_text())


def section(site: Path, name: str, qualname: str) -> str:
    """The text of the reference's entry for ``qualname``: from its heading to the next
    object's heading of the same level (mkdocstrings nests each object in a ``div.doc``)."""
    raw = (site / "reference" / name / "index.html").read_text()
    start = raw.index(">", raw.index(f'id="{qualname}"')) + 1  # after the heading's own tag
    end = len(raw)
    for m in re.finditer(r'id="asyncckpt\.[\w.]+"', raw[start:]):
        if not m.group(0).startswith(f'id="{qualname}.'):
            end = raw.rindex("<", 0, start + m.start())  # before the next heading's tag
            break
    return html.unescape(re.sub(r"<[^>]+>", "", raw[start:end]))


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_field_is_shown_with_its_description(site, name):
    built = page(site, name)
    missing, bare = [], []
    for cls_name in FIELDS[name]:
        cls = getattr(asyncckpt, cls_name)
        for f in dataclasses.fields(cls):
            ident = f"asyncckpt.{cls_name}.{f.name}"
            if ident not in built.ids:
                missing.append(ident)
                continue
            # The heading shows the name, the signature its type and default: what is left is
            # the field's own description.
            lines = section(site, name, ident).splitlines()
            text = " ".join(ln for ln in lines if ln.strip() != f.name and f"{f.name}:" not in ln)
            words = re.findall(r"[a-z]{3,}", text)
            if len(words) < 3:
                bare.append(ident)
    assert not missing, f"fields not on the {name} page: {missing}"
    assert not bare, f"fields shown without a description on the {name} page: {bare}"


def test_the_issue_fields_are_on_the_reference(site):
    api, options = page(site, "api"), page(site, "options")
    for ident in ("asyncckpt.SaveStats.bytes_written", "asyncckpt.SaveStats.files_linked"):
        assert ident in api.ids, ident
    assert "asyncckpt.Staging.max_host_bytes" in options.ids


@pytest.mark.parametrize("cls_name", ENGINES)
def test_the_engines_signature_shows_every_parameter_with_its_default(site, cls_name):
    text = re.sub(r"\s+", " ", section(site, "api", f"asyncckpt.{cls_name}"))
    params = inspect.signature(getattr(asyncckpt, cls_name)).parameters.values()
    missing = []
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            continue
        want = p.name if p.default is p.empty else f"{p.name}: "
        if want not in text:
            missing.append(p.name)
            continue
        if p.default is not p.empty:
            shown = re.search(rf"\b{p.name}: [^=]*?= (\S+?)[,)]", text)
            # As the code writes it (the signature is formatted: strings in double quotes).
            written = {repr(p.default), f'"{p.default}"' if isinstance(p.default, str) else ""}
            if not shown or shown.group(1) not in written:
                missing.append(f"{p.name}={p.default!r}")
    assert not missing, f"{cls_name}: not in its signature on the API page: {missing}"


@pytest.mark.parametrize("name", ["api", "options", "errors"])
def test_examples_render_as_code_not_quotes(site, name):
    built = page(site, name)
    assert built.max_quote_depth < 2, f"nested blockquotes on the {name} page"
    assert not any(re.search(r"\b(?:await|async with|engine\.)", q) for q in built.quoted), name
    if name == "api":  # the engine's own example, as a Python console session
        assert any(">>> engine = CheckpointEngine(" in c for c in built.code_blocks())


def test_doctest_runs_are_fenced_and_fences_left_alone():
    import importlib.util

    pytest.importorskip("griffe")  # the docs extra's (mkdocstrings'): CI's docs stage runs this

    spec = importlib.util.spec_from_file_location("griffe_doctest", REPO / "scripts" / "griffe_doctest.py")  # fmt: skip
    assert spec is not None and spec.loader is not None
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    text = "Intro.\n>>> x = 1\n... y = 2\n3\n\nAfter.\n```python\n>>> kept\n```"
    assert ext.fence_doctests(text) == (
        "Intro.\n\n```pycon\n>>> x = 1\n... y = 2\n3\n```\n\nAfter.\n```python\n>>> kept\n```"
    )


@pytest.mark.parametrize("name", ["api", "options", "errors", "cli", "on-disk-format"])
def test_the_reference_speaks_the_users_language(site, name):
    """Docstrings rendered on the reference name no internal module file (``sync.py``,
    ``options.py``...) and no internal class: what a user reads is what they can import."""
    raw = (site / "reference" / name / "index.html").read_text()
    text = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<pre.*?</pre>", "", raw, flags=re.S)))
    files = sorted(set(re.findall(r"\b[a-z_]+\.py\b", text)) - {"setup.py", "snippet.py"})
    assert not files, f"internal file names on the {name} page: {files}"
    assert "EngineParts" not in text
