"""The package's import graph has no circles: every module stands above what it imports, so a
newcomer can read the pipeline from the bottom up (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncckpt

PACKAGE = Path(asyncckpt.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import sub`` imports the submodule, not the package's face.
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    graph = import_graph()
    assert "asyncckpt.formats.base" in graph["asyncckpt.formats.loadcheck"]
    assert "asyncckpt.core.entries" in graph["asyncckpt.formats.dcp"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_no_import_circles():
    assert cycles(import_graph()) == []


# ------------------------------------------------------------------------------ the engine's shape
# Issue 23, item 3: the engine is parts with explicit interfaces, not a god class with mixins.

#: No class in the package is longer than this (the engine's core was 875 lines).
MAX_CLASS_LINES = 450
REPO = PACKAGE.parent


def _classes() -> list[tuple[str, ast.ClassDef]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.append((_module_name(path), node))
    return out


def test_no_class_is_a_god_class():
    sizes = {f"{m}.{c.name}": c.end_lineno - c.lineno + 1 for m, c in _classes()}
    big = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"
    assert sizes["asyncckpt.trainer.saving.Saver"] > 0  # the parts exist where the README says


def _foreign_attributes(cls: ast.ClassDef) -> set[str]:
    """``self.<name>`` that ``cls`` reads but neither assigns nor defines: its subclass's."""
    own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            own.add(n.target.id)
        elif isinstance(n, ast.Assign):
            own.update(t.id for t in n.targets if isinstance(t, ast.Name))
    read = set()
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            (own.add if isinstance(n.ctx, ast.Store) else read.add)(n.attr)
    return read - own


def test_no_base_class_is_a_mixin_over_its_subclass():
    """A base class of the package's own uses only what it defines itself: a mixin that reads
    and writes its subclass's attributes (supervisor.py over the engine's core, 26 names) is a
    contract that nothing checks."""
    own = {c.name: c for _, c in _classes()}
    assert _foreign_attributes(
        ast.parse("class M:\n    def f(self):\n        return self.root").body[0]
    ) == {"root"}
    bad = {}
    for module, cls in _classes():
        for base in cls.bases:
            parent = own.get(ast.unparse(base).rpartition(".")[2])
            if parent is None or any(
                ast.unparse(b).rpartition(".")[2] not in own for b in parent.bases
            ):
                continue  # (a subclass of torch's, say: what it reads may be torch's)
            if _foreign_attributes(parent):
                bad[f"{module}.{cls.name}"] = sorted(_foreign_attributes(parent))
    assert not bad, f"mixins: {bad}"


def test_no_override_is_silenced():
    hits = [
        str(p.relative_to(REPO))
        for p in PACKAGE.rglob("*.py")
        if "type: ignore[override]" in p.read_text()
    ]
    assert not hits, hits


def test_tests_and_benchmarks_use_public_api_or_the_test_hook():
    """Not ``engine._core`` (or ``engine._engine``): ``asyncckpt.testing`` is the documented
    way in."""
    reaching = []
    for folder in ("tests", "benchmarks", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == Path(__file__).name:
                continue
            text = path.read_text()
            if "._core" in text or "._engine" in text:
                reaching.append(str(path.relative_to(REPO)))
    assert not reaching, reaching


def test_the_rank_has_one_source():
    """Every part reads the rank from ``EngineParts.ranks`` (``Ranks``), resolved once."""
    engine_src = (PACKAGE / "engine.py").read_text()
    assert "opts.rank" not in engine_src and "self.rank =" not in engine_src
    for module in ("trainer/supervisor.py", "trainer/saving.py", "trainer/jobs.py"):
        assert "opts.rank" not in (PACKAGE / module).read_text(), module


# ------------------------------------------------------------------ the write side is one seam
#: Calls that change names on a disk, sync them or lock them (issue 23): only storage/ makes
#: them (``storage/localfs.py`` under ``LocalStore``), so every durable write has one doorway.
WRITE_SIDE = {
    "os": {
        "rename", "replace", "unlink", "remove", "rmdir", "mkdir", "makedirs", "fsync",
        "fdatasync", "ftruncate", "truncate", "write", "pwrite", "link", "symlink", "chmod",
        "removedirs", "renames",
    },
    "fcntl": {"flock", "lockf"},
    "shutil": {"rmtree", "move", "copytree", "copyfile", "copy", "copy2"},
}  # fmt: skip

#: The exceptions, each a write of a file's *bytes* by the code that produces them, inside a
#: temporary that the commit order then seals and publishes through the store:
ALLOWED = {
    # The O_DIRECT file writer: ``os.write`` of aligned blocks and the ``ftruncate`` that
    # drops the tail's padding are how that file's bytes are written, not a change of names.
    ("asyncckpt/io/directio.py", "os.pwrite"),
    ("asyncckpt/io/directio.py", "os.ftruncate"),
    # A replica's buffer is an anonymous file in memory (memfd, no name on any disk): its
    # ``ftruncate`` sizes memory a stand-in process maps by descriptor.
    ("asyncckpt/memory/replication.py", "os.ftruncate"),
}


#: ``pathlib.Path`` methods that change names on a disk, called as ``<anything>.<method>(``
#: (``rename``/``replace`` only with one positional argument: ``str.replace`` takes two).
PATH_WRITE_SIDE = {
    "mkdir", "write_bytes", "write_text", "unlink", "rmdir", "touch", "rename", "replace",
    "symlink_to",
}  # fmt: skip

#: The exceptions to ``PATH_WRITE_SIDE`` (file, receiver.method), each with its reason:
ALLOWED_PATH = {
    # The formats make the subdirectories of the files they write inside the step's temporary
    # (made by ``LocalStore.stage``, sealed and published by commit.py), as directio writes
    # bytes: their names become durable with the temporary, never visible before its publish.
    ("asyncckpt/formats/pt.py", "mkdir"),
    ("asyncckpt/formats/megatron_legacy.py", "mkdir"),
    ("asyncckpt/formats/components.py", "mkdir"),
}


def _path_write(node: ast.Call) -> str | None:
    func = node.func
    if not isinstance(func, ast.Attribute) or func.attr not in PATH_WRITE_SIDE:
        return None
    if isinstance(func.value, ast.Name) and func.value.id in (
        *WRITE_SIDE,
        "localfs",
        "dataclasses",
    ):
        return None  # a module's function: the module rule above, or the storage doorway
    if func.attr in ("rename", "replace") and (len(node.args) != 1 or node.keywords):
        return None  # str.replace(old, new), dataclasses.replace(obj, **changes)
    return func.attr


def write_side_calls(package: Path = PACKAGE) -> list[tuple[str, str, int]]:
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            if (
                isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.attr in WRITE_SIDE.get(node.func.value.id, ())
            ):
                out.append((rel, f"{node.func.value.id}.{node.func.attr}", node.lineno))
            elif (method := _path_write(node)) is not None:
                out.append((rel, f"<path>.{method}", node.lineno))
    return out


def test_the_write_side_check_sees_a_call(tmp_path):
    pkg = tmp_path / "asyncckpt"
    (pkg / "storage").mkdir(parents=True)
    (pkg / "commit.py").write_text("import os\ndef f(a, b):\n    os.rename(a, b)\n")
    (pkg / "storage" / "local.py").write_text("import fcntl\nfcntl.flock(0, 0)\n")
    (pkg / "worker.py").write_text(
        "def f(p, q, s):\n    p.mkdir(exist_ok=True)\n    (p / 'x').write_bytes(b'')\n"
        "    p.rename(q)\n    s.replace('a', 'b')\n    localfs.mkdir(p)\n"
    )
    assert write_side_calls(pkg) == [
        ("asyncckpt/commit.py", "os.rename", 3),
        ("asyncckpt/storage/local.py", "fcntl.flock", 2),
        ("asyncckpt/worker.py", "<path>.mkdir", 2),
        ("asyncckpt/worker.py", "<path>.write_bytes", 3),
        ("asyncckpt/worker.py", "<path>.rename", 4),
    ]


def test_only_storage_writes_to_the_disk():
    outside = [
        (rel, call, line)
        for rel, call, line in write_side_calls()
        if not rel.startswith("asyncckpt/storage/")
        and (rel, call) not in ALLOWED
        and (rel, call.removeprefix("<path>.")) not in ALLOWED_PATH
    ]
    assert outside == [], "write-side calls outside asyncckpt/storage/ (use LocalStore/localfs)"


def test_the_lock_name_is_spelled_once():
    """Its literal in layout.py, the file of a lock made in localfs.lock_path only."""

    def files_with(text: str) -> list[str]:
        return sorted(
            p.relative_to(PACKAGE.parent).as_posix()
            for p in PACKAGE.rglob("*.py")
            if text in p.read_text()
        )

    assert files_with('".asyncckpt.lock') == ["asyncckpt/core/layout.py"]
    assert files_with("LOCK_NAME") == ["asyncckpt/core/layout.py", "asyncckpt/storage/localfs.py"]


# ------------------------------------------------------------------------- wings and typed seams
# Issue 52: the layout shows the pipeline. Each wing is a subpackage (or a top-level module)
# with a place in this order, bottom to top; a module imports only from its own layer or lower
# ones (imports inside functions count: they are the same dependency, only later).
LAYERS: list[tuple[str, ...]] = [
    ("errors", "faults", "_torch", "retention"),  # words every wing uses
    ("core",),  # the shared vocabulary: state trees, shards, names on disk, messages
    ("io",),  # how the worker writes: throttle, direct I/O, threads, CPU limits
    ("options",),  # the engine's option objects (io's ThrottleConfig among them)
    ("storage",),  # every durable write: stores, commit, prune, manifest
    ("stats",),  # the figures a save reports
    ("staging",),  # the trainer's copy into reused buffers
    ("cluster",),  # ranks and nodes: rendezvous, side store, peers, node-local recovery
    ("formats",),  # on-disk formats and the checks around a load
    ("memory",),  # the memory tier and hot resume, both sides
    ("worker",),  # the background process
    ("trainer",),  # the engine's parts in the training process
    # the faces users import
    ("engine", "sync", "export", "frameworks", "tensorboard", "testing", "cli", "integrations"),
    ("__main__", ""),  # ``python -m asyncckpt`` and the package itself
]
LEVEL = {wing: i for i, wings in enumerate(LAYERS) for wing in wings}


def wing_of(module: str) -> str:
    """``asyncckpt.memory.tier`` -> ``memory``; ``asyncckpt.engine`` -> ``engine``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if LEVEL[wing_of(t)] > LEVEL[wing_of(m)]
    )


def test_the_wing_check_sees_an_upward_import():
    graph = {"asyncckpt.memory.tier": {"asyncckpt.trainer.jobs", "asyncckpt.core.layout"}}
    assert upward_imports(graph) == ["asyncckpt.memory.tier -> asyncckpt.trainer.jobs"]


def test_every_module_has_a_wing():
    assert sorted({wing_of(m) for m in import_graph()} - set(LEVEL)) == []


def test_no_wing_imports_a_higher_one():
    assert upward_imports(import_graph()) == []


#: What the issue's cap meant: no more than this many modules flat under the package.
MAX_TOP_MODULES = 20
MAX_MODULE_LINES = 800
MAX_IMPORTS_IN_FUNCTIONS = 40
MAX_TOP_TEST_FILES = 12
#: Names of the objects whose behaviour belongs in their classes or behind a Protocol.
HUB_NAMES = {"saver", "worker", "engine", "core", "parts", "owner"}


def test_few_modules_lie_flat():
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= MAX_TOP_MODULES, flat


def test_no_module_is_too_long():
    long = {
        str(p.relative_to(REPO)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


def hub_functions(tree: ast.Module) -> list[str]:
    """Module-level functions whose first parameter is a saver/worker/engine object typed
    ``Any`` or not typed: a class's method living outside it, over a contract mypy cannot see."""
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.args.args:
            continue
        first = node.args.args[0]
        loose = first.annotation is None or ast.unparse(first.annotation) in ("Any", "'Any'")
        if loose and first.arg.lstrip("_") in HUB_NAMES:
            out.append(f"{node.name}({first.arg})")
    return out


def test_the_hub_check_sees_a_function_over_any():
    src = "def save(saver: Any, step): ...\ndef ok(saver: Saver): ...\ndef f(worker, x): ...\n"
    assert hub_functions(ast.parse(src)) == ["save(saver)", "f(worker)"]


def test_no_function_takes_a_hub_as_any():
    hits = {
        str(p.relative_to(REPO)): found
        for p in PACKAGE.rglob("*.py")
        if (found := hub_functions(ast.parse(p.read_text())))
    }
    assert not hits, hits


def imports_in_functions(tree: ast.Module) -> int:
    count = 0
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").split(".")[0] == "asyncckpt"
                ):
                    count += 1
                elif isinstance(node, ast.Import) and any(
                    a.name.split(".")[0] == "asyncckpt" for a in node.names
                ):
                    count += 1
    return count


def test_few_imports_hide_in_functions():
    assert imports_in_functions(ast.parse("def f():\n    from asyncckpt import x\n")) == 1
    per_file = {
        str(p.relative_to(REPO)): n
        for p in PACKAGE.rglob("*.py")
        if (n := imports_in_functions(ast.parse(p.read_text())))
    }
    assert sum(per_file.values()) <= MAX_IMPORTS_IN_FUNCTIONS, per_file


def test_every_module_is_on_the_design_map():
    """docs/design.md names every module (by its dotted name, in the module map)."""
    design = (REPO / "docs" / "design.md").read_text()
    missing = sorted(
        m
        for m, path in ((_module_name(p), p) for p in PACKAGE.rglob("*.py"))
        if f"`{m}`" not in design and path.name != "__main__.py"
    )
    assert not missing, missing


def test_each_wing_says_what_its_modules_do():
    """A wing's ``__init__`` docstring has a line for each of its modules."""
    missing = {}
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = [p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        names += [p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()]
        absent = sorted(n for n in names if f"``{n}``" not in doc and f"{n}.py" not in doc)
        if absent:
            missing[init.parent.name] = absent
    assert not missing, missing


def test_tests_mirror_the_wings():
    top = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    assert len(top) <= MAX_TOP_TEST_FILES, top
    wings = {wing for wings in LAYERS for wing in wings}
    for folder in (REPO / "tests").iterdir():
        if folder.is_dir() and any(folder.glob("test_*.py")):
            assert folder.name in wings | {"e2e", "bench"}, folder
