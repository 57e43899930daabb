"""The documentation site (issue 36): every Python block of every page under docs/ runs, in a
fresh directory per page, with the checkout's asyncckpt, and prints what the page says it
prints (a ```text block right after it). A block that cannot run here is marked in the page
source, right before its fence: ``<!-- not run: why -->``, or ``<!-- run by: tests/x.py -->``
for a block an integration's own test module runs (it needs that integration, "# requires:"
on its first line). The marked blocks are exactly those listed below: a new one must be added
here on purpose. `mkdocs build --strict` (broken links, missing references) is `.ci/run`'s.
Issue 54: the built site shows no Markdown as typed (a stray fence), and the user pages (all
but the design and benchmark pages) and the README speak the user's words, not the code's."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest
from snippets import env, run_python

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)  # fmt: skip
MARK = re.compile(r"<!--\s*(not run|run by):\s*(.*?)\s*-->\s*$")

#: (page, why) of every block marked ``<!-- not run: why -->``.
NOT_RUN = {
    ("how-to/multi-rank.md", "needs torchrun (several processes)"),
    ("how-to/migrating.md", "the code being replaced, a fragment"),
}
#: (page, test module) of every block marked ``<!-- run by: ... -->``.
RUN_BY = {
    ("how-to/pytorch-loop.md", "tests/test_stats.py"),
    ("how-to/lightning.md", "tests/integrations/test_lightning.py"),
    ("how-to/hf-trainer.md", "tests/integrations/test_hf_trainer.py"),
    ("how-to/object-storage.md", "tests/storage/test_s3.py"),
    ("how-to/hf-export.md", "tests/worker/test_export.py"),
}
#: A page whose first block is run a second time, printing its n-th ```text block: the
#: Getting started loop, run again, resumes.
RERUN = {"getting-started.md": 1}


@dataclass
class Block:
    lang: str
    code: str
    indent: str
    mark: tuple[str, str] | None  # ("not run", why) / ("run by", module)
    prints: str | None  # the ```text block right after it


def pages() -> list[str]:
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def blocks(page: str) -> list[Block]:
    text = (DOCS / page).read_text()
    found = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(found):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        after = found[i + 1] if i + 1 < len(found) else None
        prints = None
        if after and after.group("lang") == "text" and not text[m.end() : after.start()].strip():
            prints = after.group("body")
        out.append(
            Block(
                m.group("lang"),
                m.group("body"),
                m.group("indent"),
                (mark.group(1), mark.group(2)) if mark else None,
                prints,
            )
        )
    return out


def is_cli(block: Block) -> bool:
    """A shell block of asyncckpt commands only: run like the Python blocks."""
    lines = [ln.split("#", 1)[0].strip() for ln in block.code.splitlines()]
    lines = [ln for ln in lines if ln]
    return block.lang == "bash" and bool(lines) and all(
        ln.startswith("python -m asyncckpt ") for ln in lines
    )  # fmt: skip


def runnable(page: str) -> list[Block]:
    return [b for b in blocks(page) if (b.lang == "python" and b.mark is None) or is_cli(b)]


def test_the_site_has_its_pages():
    names = pages()
    assert len(names) >= 12, names
    api = (DOCS / "reference" / "api.md").read_text()
    assert "::: asyncckpt.CheckpointEngine" in api and "load_latest" in api
    nav = (REPO / "mkdocs.yml").read_text()
    for name in names:  # every page is in the navigation (mkdocs only warns otherwise)
        assert f": {name}\n" in nav, f"{name} is not in mkdocs.yml's nav"


def test_every_python_block_runs_or_is_marked():
    not_run, run_by = set(), set()
    for page in pages():
        for b in blocks(page):
            if b.lang != "python":
                assert b.mark is None, f"{page}: a mark before a {b.lang!r} block"
                continue
            # A block inside a tab or a list would be rendered but found by no simple reader.
            assert not b.indent, f"{page}: an indented Python block"
            requires = b.code.startswith("# requires:")
            if b.mark is None:
                assert not requires, f"{page}: a '# requires:' block without '<!-- run by: -->'"
            elif b.mark[0] == "not run":
                not_run.add((page, b.mark[1]))
            else:
                assert requires, f"{page}: run by {b.mark[1]}, but no '# requires:' line"
                run_by.add((page, b.mark[1]))
    assert not_run == NOT_RUN
    assert run_by == RUN_BY
    for page, module in RUN_BY:  # and that module does read the page
        assert f'"{Path(page).name}"' in (REPO / module).read_text(), (page, module)


def test_deprecated_keywords_are_listed_on_one_page():
    from asyncckpt.options import DEPRECATED

    text = (DOCS / "reference" / "deprecated.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)=` \| `(.+?)` \|$", text, re.M))
    assert rows == {name: replacement for name, (_, _, replacement) in DEPRECATED.items()}
    for page in pages():  # and nowhere else as a row of a table
        if page != "reference/deprecated.md":
            for name in DEPRECATED:
                assert f"| `{name}=` |" not in (DOCS / page).read_text(), (page, name)


@pytest.mark.parametrize("page", [p for p in pages() if runnable(p)])
def test_page_snippets_run_as_written(page, tmp_path):
    todo = runnable(page)
    for i, b in enumerate(todo):
        where = f"{page}, block {i + 1}"
        if b.lang == "python":
            out = run_python(b.code, tmp_path, where)
            if b.prints is not None:
                assert out.strip() == b.prints.strip(), f"{where} printed:\n{out}"
            if i == 0 and page in RERUN:
                texts = [x for x in blocks(page) if x.lang == "text"]
                again = run_python(b.code, tmp_path, where + " (again)")
                assert again.strip() == texts[RERUN[page]].code.strip(), again
            continue
        for line in b.code.splitlines():
            cmd = line.split("#", 1)[0].strip()
            if cmd:
                argv = shlex.split(cmd)
                r = subprocess.run(
                    [sys.executable, *argv[1:]], cwd=tmp_path, env=env(), capture_output=True,
                    text=True, timeout=120,
                )  # fmt: skip
                assert r.returncode == 0, f"{where}: {cmd}\n{r.stdout}\n{r.stderr}"


class _PageText(HTMLParser):
    """A rendered page's text, split into prose and code (inside <pre> or <code>)."""

    VOID = {"area", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.prose: list[str] = []
        self.code: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.open:
            while self.open.pop() != tag:
                pass

    def handle_data(self, data: str) -> None:
        if "script" in self.open or "style" in self.open:
            return
        code = "pre" in self.open or "code" in self.open
        (self.code if code else self.prose).append(data)


#: Markdown that rendered would not be seen as these characters in a page's prose.
UNRENDERED = {
    "a code fence": re.compile(r"```|~~~"),
    "an inline-code backtick": re.compile(r"`"),
    "bold or emphasis marks": re.compile(r"\*\*\S|\S\*\*|(?<!\w)__\w+__(?!\w)"),
    "a link's brackets": re.compile(r"\]\([^)\s]+\)|\]\[[^\]]*\]"),
    "a table's pipes": re.compile(r"^[ \t]*\|.*\|[ \t]*$", re.M),
    "a heading's hashes": re.compile(r"^#{1,6} ", re.M),
    "an admonition or directive": re.compile(r"^[ \t]*(!!!|\?\?\?|:::) ", re.M),
    "an HTML comment": re.compile(r"<!--|-->"),
}


def unrendered(html: str) -> list[str]:
    """Each piece of Markdown a rendered page shows as it was typed, with its surroundings."""
    text = _PageText()
    text.feed(html)
    prose, code = "\n".join(text.prose), "\n".join(text.code)
    found = []
    for what, pattern in [*UNRENDERED.items(), ("a code fence in a code block", re.compile("```"))]:
        where = code if what == "a code fence in a code block" else prose
        for m in pattern.finditer(where):
            found.append(f"{what}: ...{where[max(0, m.start() - 60) : m.end() + 60]!r}...")
    return found


def test_unrendered_markdown_is_found():
    assert not unrendered(
        "<p>A <code>`x`</code> and <strong>b</strong></p><pre><code>a ** 2</code></pre>"
    )
    assert unrendered("<p>a **b** c</p>") and unrendered("<pre><code>```python\nx = 1</code></pre>")
    assert unrendered("<p>| a | b |</p>") and unrendered("<p>see [it](x.md)</p>")


def test_every_page_renders(tmp_path):
    """The built site shows no Markdown as typed: a stray fence turns the rest of a page into one
    code block, and `mkdocs build --strict` does not see it."""
    pytest.importorskip("mkdocs")
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    built = sorted(site.rglob("*.html"))
    assert len(built) > len(pages()), built
    bad = {str(f.relative_to(site)): found for f in built if (found := unrendered(f.read_text()))}
    assert not bad, bad


#: Pages about the code itself, which may name its modules, invariants and history.
DESIGN_PAGES = {"design.md", "faults.md", "benchmarks.md", "benchmarks-full.md"}

#: What a user page says in the code's words, not the user's.
INTERNAL = {
    "a package file": re.compile(r"\basyncckpt/[\w/]*\.py\b"),
    "a test file": re.compile(r"\b(?:tests/[\w/]*|test_\w*)\.py\b"),
    "an issue number": re.compile(r"\bissues? #?\d+", re.I),
    "an invariant number": re.compile(r"\binvariants? #?\d+", re.I),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "the project's own history": re.compile(r"this project's|torch[ _]matrix", re.I),
}


def user_pages() -> list[str]:
    return [p for p in pages() if p not in DESIGN_PAGES]


def internal_words(text: str, modules: set[str]) -> list[str]:
    """Each place ``text`` (a page's Markdown) speaks of internals; code blocks and comments,
    which a reader of the page does not see as prose, are left out."""
    prose = re.sub(r"<!--.*?-->", "", FENCE.sub("", text), flags=re.S)
    found = [f"{what}: {m.group()!r}" for what, rx in INTERNAL.items() for m in rx.finditer(prose)]
    for m in re.finditer(r"(?<![\w/.])(\w+)\.py\b", prose):  # a module's bare file name
        if m.group(1) in modules:
            found.append(f"a module's file name: {m.group()!r}")
    return found


def test_internal_words_are_found():
    modules = {"bytecheck", "differential"}
    assert len(internal_words("(bytecheck.py) and `asyncckpt/core/layout.py`", modules)) == 2
    assert len(internal_words("fixed in 81bb6c8, issue 34 item 2, invariant 13", modules)) == 3
    assert len(internal_words("this project's machines; `tests/e2e/test_x.py`", modules)) == 2
    ok = "`benchmarks/differential.py` and `train.py`, 1024 bytes, `asyncckpt.faults`"
    assert not internal_words(ok + "\n```python\n# deadbeef1 bytecheck.py\n```\n", modules)


def test_user_pages_speak_the_users_words():
    """Getting started, concepts, how-to and reference say what happens, which option and what
    the user sees; module files, issue and invariant numbers, commits and the project's history
    belong on the design pages."""
    modules = {p.stem for p in (REPO / "asyncckpt").rglob("*.py")} - {"__init__", "__main__"}
    texts = {page: (DOCS / page).read_text() for page in user_pages()}
    texts["README.md"] = (REPO / "README.md").read_text()
    bad = {page: found for page, text in texts.items() if (found := internal_words(text, modules))}
    assert not bad, bad


def test_every_test_file_named_in_the_docs_and_scripts_exists():
    """The GPU suite ran `tests/test_cuda.py` for days after the tests moved into wings
    (tests/e2e/): its test step found no file and the dry run failed, unseen."""
    named = [
        REPO / "README.md",
        REPO / ".ci" / "run",
        *REPO.glob("docs/**/*.md"),
        *REPO.glob("benchmarks/*.md"),
        *REPO.glob("benchmarks/*.sh"),
        *REPO.glob("benchmarks/*.py"),
        *REPO.glob("scripts/*"),
    ]
    missing = [
        f"{f.relative_to(REPO)}: {m.group(0)}"
        for f in named
        if f.is_file()
        for m in re.finditer(r"tests/[\w/]+\.py", f.read_text())
        if not (REPO / m.group(0)).exists()
    ]
    assert missing == []
