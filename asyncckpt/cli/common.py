"""What every subcommand shares: the registry of subcommands, the errors that set the exit
code, the root argument and opening its store, the checks of every checkpoint, and the
formatting of sizes, times and tables.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from asyncckpt.core import layout as L
from asyncckpt.core.paths import check_local_root, is_url
from asyncckpt.core.progress import RichProgress
from asyncckpt.retention import (
    CheckpointInfo,
)
from asyncckpt.storage import open_store
from asyncckpt.storage.base import Store
from asyncckpt.storage.fsspec_store import FsspecStore
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.prune import list_checkpoints, list_quarantined
from asyncckpt.storage.remote import UploadFailed

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def subcommand(add: Callable[[argparse._SubParsersAction], None]) -> Callable:
    """Register a function that adds one subcommand to the parser (e.g. ``verify``)."""
    SUBCOMMANDS.append(add)
    return add


class UsageError(Exception):
    """Bad arguments found after parsing; reported with exit code 2."""


class Failure(Exception):
    """A clear error about the root or its contents; reported with exit code 1."""


def add_root(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "root", help="checkpoint root: a local or mounted path, or an object-store URL (s3://...)"
    )
    p.add_argument("--layout", choices=("auto", *L.LAYOUTS), default="auto")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an fsspec option for a URL root (e.g. endpoint_url=http://host:9000); a VALUE "
        "that parses as JSON is used as such (true, 3); repeatable",
    )


def open_root(args: argparse.Namespace) -> tuple[Store, str]:
    """The store of ``args.root`` (a path or a URL, ``--storage-option`` parsed) and its
    layout, or a clear error (a missing directory, a wrong bucket)."""
    options: dict[str, Any] = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    if not is_url(args.root):
        if options:
            raise UsageError("--storage-option is for a URL root, not a local path")
        root = check_local_root(args.root)
        if not root.exists():
            raise Failure(f"no such directory: {args.root}")
        if not root.is_dir():
            raise Failure(f"not a directory: {args.root}")
        refuse_step_dir(Path(args.root))
    try:
        store = open_store(args.root, options)
        if isinstance(store, FsspecStore):
            bucket = store.base.split("/")[0]  # reach it now: a wrong bucket fails here
            if not store.fs.exists(bucket):
                raise Failure(f"no such bucket (or no access to it): {bucket} of {args.root}")
        layout = store.detect_layout() if args.layout == "auto" else args.layout
    except UploadFailed as e:
        raise Failure(str(e)) from e
    except (OSError, ValueError) as e:
        raise Failure(f"cannot read {args.root}: {e}") from e
    return store, layout


def refuse_step_dir(root: Path) -> None:
    """A ``Failure`` saying to pass the parent when ``root`` is one checkpoint's directory
    (``ckpts/global_step_1000``) rather than a root, as the engine's load says."""
    named_like_one = any(L.parse_dir_name(lay, root.name) is not None for lay in L.LAYOUTS)
    if not named_like_one or any(L.scan(root, lay) for lay in L.LAYOUTS):
        return  # a root (an odd name for one, maybe): its checkpoints are there
    if (root / L.DCP_METADATA).exists() or (root / L.MANIFEST).exists() or any(root.iterdir()):
        raise Failure(
            f"{root} is a checkpoint directory, not a checkpoint root; pass its parent "
            f"({root.parent}) as the root"
        )


def no_checkpoints(store: Store, root: str, layout: str) -> str:
    """Why a root shows no checkpoint, with a hint when the other layout's names are there."""
    msg = f"no checkpoints found in {root} (layout {layout})"
    others = [lay for lay in L.LAYOUTS if lay != layout and store.committed(lay)]
    if others:
        msg += f"; it holds {others[0]} checkpoints (pass --layout {others[0]})"
    return msg


def progress_bar() -> RichProgress:
    """A bar on stderr while a terminal shows it; nothing at all otherwise."""
    return RichProgress(Console(stderr=True, markup=False, soft_wrap=True))


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def local_time(t: float) -> str:
    return _dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def metrics_text(m: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in sorted(m.items()))


def make_table(title: str, rows: Sequence[Sequence[str]], columns: Sequence[str]) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*r)
    return t


def quarantined_entries(store: Store, layout: str) -> list[dict[str, Any]]:
    """Checkpoints the engine found corrupt and moved into ``<root>/.quarantine/``: no longer
    checkpoints (not listed, loaded, pruned or verified), shown so that nobody misses them."""
    return [
        {
            "step": q.step,
            "name": q.name,
            "path": str(q.path),
            "quarantined_at": q.at,
            "problems": q.problems,
        }
        for q in (list_quarantined(store.root, layout) if isinstance(store, LocalStore) else [])
    ]


def print_quarantined(console: Console, quarantined: list[dict[str, Any]]) -> None:
    for q in quarantined:
        when = local_time(q["quarantined_at"]) if q["quarantined_at"] is not None else "?"
        why = "; ".join(q["problems"]) or "reason unknown"
        console.print(
            f"quarantined (found corrupt on {when}, not a checkpoint any more): {q['name']} "
            f"-> {q['path']}: {why}",
            style="yellow",
        )


def step_label(step: int, tier: str | None, why: str | None) -> str:
    """The step, and for a memory-tier checkpoint that it is one and why it was written."""
    if tier != "memory":
        return str(step)
    return f"{step} (memory: {why})" if why else f"{step} (memory)"


def check_all(
    store: Store, layout: str, quick: bool
) -> tuple[list[CheckpointInfo], dict[int, list[str]], dict[int, str]]:
    """Every committed checkpoint of ``store``: what it is, its problems (sizes only when
    ``quick``; every checksum otherwise) and its name, with a progress bar on a terminal."""
    infos = list_checkpoints(store, layout)
    names = {c.step: c.name for c in store.committed(layout)}
    infos = [c for c in infos if c.step in names]
    problems: dict[int, list[str]] = {}
    with progress_bar() as bar:
        bar.begin(
            "checking" if quick else "verifying",
            0 if quick else sum(c.size_bytes for c in infos),
            len(infos),
        )
        for c in infos:
            problems[c.step] = store.check(names[c.step], bar.advance, quick=quick)
            bar.checkpoint_done(c.step, not problems[c.step])
        bar.end()
    return infos, problems, names
