"""``python -m asyncckpt ls | verify | prune | stats ROOT``: inspect, check and prune any root the engine wrote.

Each subcommand is one function decorated with ``@subcommand``: it adds its parser and sets
``func`` (``(args, console) -> exit code``). Exit codes: 0 ok, 1 error, 2 bad usage.

Nothing here imports torch (``python -m asyncckpt --help`` answers at once): the CLI reads
manifests and file checksums only. Long reads show a progress bar on stderr when it is a
terminal (``asyncckpt.core.progress.RichProgress``); pipes and files get none.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import sys
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from asyncckpt.core import layout as L
from asyncckpt.core.paths import check_local_root, is_url
from asyncckpt.core.progress import RichProgress
from asyncckpt.errors import CheckpointError
from asyncckpt.retention import (
    CheckpointInfo,
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    RetentionPolicy,
    Union,
    plan_prune,
)
from asyncckpt.storage import pinfile
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.prune import disk_usage, list_checkpoints, list_quarantined, prune

__all__ = ["main", "build_parser", "subcommand"]

_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def subcommand(add: Callable[[argparse._SubParsersAction], None]) -> Callable:
    """Register a function that adds one subcommand to the parser (e.g. ``verify``)."""
    _SUBCOMMANDS.append(add)
    return add


class _UsageError(Exception):
    """Bad arguments found after parsing; reported with exit code 2."""


class _Failure(Exception):
    """A clear error about the root or its contents; reported with exit code 1."""


def _add_root(p: argparse.ArgumentParser) -> None:
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


def _open(args: argparse.Namespace) -> tuple[Any, str]:
    """The store of ``args.root`` (a path or a URL, ``--storage-option`` parsed) and its
    layout, or a clear error (a missing directory, a wrong bucket)."""
    from asyncckpt.storage import open_store
    from asyncckpt.storage.fsspec_store import FsspecStore
    from asyncckpt.storage.remote import UploadFailed

    options: dict[str, Any] = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _UsageError(f"--storage-option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    if not is_url(args.root):
        if options:
            raise _UsageError("--storage-option is for a URL root, not a local path")
        root = check_local_root(args.root)
        if not root.exists():
            raise _Failure(f"no such directory: {args.root}")
        if not root.is_dir():
            raise _Failure(f"not a directory: {args.root}")
    try:
        store = open_store(args.root, options)
        if isinstance(store, FsspecStore):
            bucket = store.base.split("/")[0]  # reach it now: a wrong bucket fails here
            if not store.fs.exists(bucket):
                raise _Failure(f"no such bucket (or no access to it): {bucket} of {args.root}")
        layout = store.detect_layout() if args.layout == "auto" else args.layout
    except UploadFailed as e:
        raise _Failure(str(e)) from e
    except (OSError, ValueError) as e:
        raise _Failure(f"cannot read {args.root}: {e}") from e
    return store, layout


def _no_checkpoints(store: Any, root: str, layout: str) -> str:
    """Why a root shows no checkpoint, with a hint when the other layout's names are there."""
    msg = f"no checkpoints found in {root} (layout {layout})"
    others = [lay for lay in L.LAYOUTS if lay != layout and store.committed(lay)]
    if others:
        msg += f"; it holds {others[0]} checkpoints (pass --layout {others[0]})"
    return msg


def _progress() -> RichProgress:
    """A bar on stderr while a terminal shows it; nothing at all otherwise."""
    return RichProgress(Console(stderr=True, markup=False, soft_wrap=True))


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _when(t: float) -> str:
    return _dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _metrics(m: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in sorted(m.items()))


def _table(title: str, rows: Sequence[Sequence[str]], columns: Sequence[str]) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*r)
    return t


@subcommand
def _add_ls(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ls",
        help="list committed checkpoints, which are protected, leftovers, quarantined ones",
        description="List committed checkpoints: step, commit time, size, metrics, status, "
        "what protects them. The status column ('ok' or 'CORRUPT: reason') compares every "
        "file's size with the manifest by default (fast, reads no data: catches missing and "
        "truncated shards); --verify also reads every byte and checks its checksum (as `verify`). "
        "Checkpoints a load found corrupt, moved into ROOT/.quarantine/, are listed after them.",
    )
    _add_root(p)
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every file's checksum, not only its size (reads the whole root)",
    )
    p.set_defaults(func=_run_ls)


def _status(problems: list[str] | None) -> str:
    if problems is None:
        return "?"
    return "ok" if not problems else "CORRUPT: " + "; ".join(problems)


def _ls_entries(infos: list, problems: dict[int, list[str]], protected: dict) -> list[dict]:
    """One dict per checkpoint: what ``ls --json`` prints and the table shows."""
    return [
        {
            "step": c.step,
            "committed_at": c.committed_at,
            "bytes": c.size_bytes,
            "metrics": dict(c.metrics),
            "run_id": c.run_id,
            "metadata": dict(c.metadata),
            "tier": c.tier,
            "persisted_because": c.persisted_because,
            "protected": [r for r in protected.get(c.step, []) if r != "KeepAll()"],
            "status": _status(problems.get(c.step)),
            "problems": problems.get(c.step, []),
        }
        for c in infos
    ]


def _quarantined(store: Any, layout: str) -> list[dict[str, Any]]:
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


def _print_quarantined(console: Console, quarantined: list[dict[str, Any]]) -> None:
    for q in quarantined:
        when = _when(q["quarantined_at"]) if q["quarantined_at"] is not None else "?"
        why = "; ".join(q["problems"]) or "reason unknown"
        console.print(
            f"quarantined (found corrupt on {when}, not a checkpoint any more): {q['name']} "
            f"-> {q['path']}: {why}",
            style="yellow",
        )


def _ls_rows(entries: list[dict]) -> list[tuple[str, ...]]:
    return [
        (
            _step_label(e["step"], e.get("tier"), e.get("persisted_because")),
            _when(e["committed_at"]),
            _human(e["bytes"]),
            _metrics(e["metrics"]),
            json.dumps(e["metadata"], separators=(",", ":")) if e["metadata"] else "",
            e["status"],
            ", ".join(e["protected"]),
        )
        for e in entries
    ]


def _step_label(step: int, tier: str | None, why: str | None) -> str:
    """The step, and for a memory-tier checkpoint that it is one and why it was written."""
    if tier != "memory":
        return str(step)
    return f"{step} (memory: {why})" if why else f"{step} (memory)"


def _checked(
    store: Any, layout: str, quick: bool
) -> tuple[list[CheckpointInfo], dict[int, list[str]], dict[int, str]]:
    """Every committed checkpoint of ``store``: what it is, its problems (sizes only when
    ``quick``; every checksum otherwise) and its name, with a progress bar on a terminal."""
    infos = list_checkpoints(store, layout)
    names = {c.step: c.name for c in store.committed(layout)}
    infos = [c for c in infos if c.step in names]
    problems: dict[int, list[str]] = {}
    with _progress() as bar:
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


def _usage(store: Any, layout: str, infos: list[CheckpointInfo]) -> dict[str, int]:
    if isinstance(store, LocalStore):
        return disk_usage(store.root, layout)
    return {"committed_bytes": sum(c.size_bytes for c in infos), "checkpoints": len(infos)}


def _run_ls(args: argparse.Namespace, console: Console) -> int:
    store, layout = _open(args)
    quick = not args.verify
    infos, problems, _ = _checked(store, layout, quick)
    tracker = store.read_tracker()
    pinned = pinfile.live_pins(store.root) if isinstance(store, LocalStore) else {}
    protected = plan_prune(infos, None, tracker_step=tracker, pinned=pinned).keep
    writes, leftovers, pending = _background(store, layout)
    usage = _usage(store, layout, infos)
    entries = _ls_entries(infos, problems, protected)
    quarantined = _quarantined(store, layout)
    checked = "sizes" if quick else "checksums"
    if args.json:
        out = {
            "root": str(args.root),
            "layout": layout,
            "tracker": tracker,
            "checkpoints": entries,
            "in_progress": writes,
            "leftovers": leftovers,
            "uploads_pending": pending,
            "quarantined": quarantined,
            "usage": usage,
            "checked": checked,
        }
        console.print_json(json.dumps(out))
        return 0
    rows = _ls_rows(entries)
    cols = ("step", "committed", "size", "metrics", "metadata", f"status ({checked})", "protected")
    console.print(_table(f"{args.root} ({layout})", rows, cols))
    if not infos:
        console.print(_no_checkpoints(store, args.root, layout))
    line = f"tracker: {tracker}  committed: {_human(usage['committed_bytes'])}"
    if "free_bytes" in usage:
        line += (
            f"  leftovers: {_human(usage['leftover_bytes'])}  free: {_human(usage['free_bytes'])}"
        )
    console.print(line)
    if tracker is not None and tracker not in {c.step for c in infos}:
        console.print(
            f"warning: the tracker names step {tracker}, which is not here", style="yellow"
        )
    for w in writes:
        console.print(_write_line(w))
    for name in leftovers:
        console.print(f"leftover: {name} (its writer is gone; cleaned at the next start)")
    if pending is not None and pending["steps"]:
        steps = ", ".join(map(str, pending["steps"]))
        console.print(f"upload pending to {pending['url'] or 'the remote tier'}: step {steps}")
    _print_quarantined(console, quarantined)
    return 0


def _background(store: Any, layout: str) -> tuple[list[dict], list[str], dict[str, Any] | None]:
    """What is under way beside the committed checkpoints: temporaries whose writer still runs
    (``LocalStore.writes``), the leftovers of writers that are gone (names), and the uploads
    a remote tier has not published yet (``remote.pending_uploads``; local roots only)."""
    if not isinstance(store, LocalStore):
        return [], store.leftovers(layout), None
    from asyncckpt.storage.remote import pending_uploads

    writes = store.writes()
    live = [w for w in writes if w["state"] != "leftover"]
    dead = [w["name"] for w in writes if w["state"] == "leftover"]
    return live, dead, pending_uploads(store.root, layout)


def _write_line(w: dict[str, Any]) -> str:
    """``in progress: step 130 (memory: trainer died) by pid 4242 on host h, rank 0, 2.1 s``."""
    import time

    if "step" not in w:  # (noted, but unreadable: being written this instant)
        return f"in progress: {w['name']}"
    label = _step_label(w["step"], w.get("tier"), w.get("persisted_because"))
    since = f", for {time.time() - w['started_at']:.1f} s" if w.get("started_at") else ""
    ranks = w.get("ranks") or [w.get("rank", 0)]
    who = f"pid {w.get('pid')} on host {w.get('host')}, rank {', '.join(map(str, ranks))}"
    if w["state"] == "unknown":
        return (
            f"in progress?: step {label} by {who} (another host: not checked){since}: {w['name']}"
        )
    return f"in progress: step {label} by {who}{since}: {w['name']}"


@subcommand
def _add_prune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prune",
        help="delete checkpoints a retention policy does not keep",
        description="Delete the checkpoints a retention policy does not keep (never the newest, "
        "nor the one the tracker names). Before deleting anything, the kept checkpoints are "
        "checked against their manifests (every byte, newest first, until one verifies); if "
        "none does, the newest one that verifies is kept too ('newest that verifies'), and if "
        "nothing verifies nothing is deleted. --no-verify skips that read. Steps a running "
        "engine protects (engine.protect) are kept too.",
    )
    _add_root(p)
    p.add_argument("--keep-last", type=int, metavar="N")
    p.add_argument("--keep-best", type=int, metavar="N")
    p.add_argument("--metric", help="metric for --keep-best")
    p.add_argument("--mode", choices=("min", "max"), default="min")
    p.add_argument(
        "--ties",
        choices=("newer", "older"),
        default=None,
        help="which of equally good checkpoints --keep-best keeps (default newer; older is "
        "Lightning's save_top_k)",
    )
    p.add_argument("--keep-every", type=int, metavar="K", help="keep steps divisible by K")
    p.add_argument(
        "--not-exact",
        action="store_true",
        help="with --keep-every K: keep the oldest, then each checkpoint at least K steps after "
        "the last kept one (Orbax's EveryNSteps(exact_interval=False)), for irregular steps",
    )
    p.add_argument(
        "--keep-interval",
        type=float,
        metavar="SECONDS",
        help="keep the oldest, then each checkpoint committed at least SECONDS after the last "
        "kept one (Orbax's keep_time_interval)",
    )
    p.add_argument("--dry-run", action="store_true", help="show the plan, delete nothing")
    p.add_argument(
        "--allow-tracker-lag",
        action="store_true",
        help="prune even if the tracker does not name the newest checkpoint (no engine running)",
    )
    p.add_argument(
        "--clean-leftovers",
        action="store_true",
        help="also remove temporaries and trash (refused, exit 1, while an engine holds "
        "ROOT's lock: its saves in flight are temporaries too)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="do not read the kept checkpoints to make sure one verifies before deleting",
    )
    p.set_defaults(func=_run_prune)


def _policy(args: argparse.Namespace) -> RetentionPolicy:
    parts: list[RetentionPolicy] = []
    try:
        if args.keep_last is not None:
            parts.append(KeepLast(args.keep_last))
        if args.keep_best is not None:
            if not args.metric:
                raise _UsageError("--keep-best needs --metric")
            parts.append(
                KeepBest(args.keep_best, args.metric, mode=args.mode, ties=args.ties or "newer")
            )
        elif args.metric:
            raise _UsageError("--metric is only used with --keep-best")
        elif args.ties:
            raise _UsageError("--ties is only used with --keep-best")
        if args.keep_every is not None:
            parts.append(KeepEvery(args.keep_every, exact=not args.not_exact))
        elif args.not_exact:
            raise _UsageError("--not-exact is only used with --keep-every")
        if args.keep_interval is not None:
            parts.append(KeepInterval(args.keep_interval))
    except (ValueError, TypeError) as e:
        raise _UsageError(str(e)) from e
    if not parts:
        raise _UsageError(
            "give a policy: --keep-last, --keep-best, --keep-every or --keep-interval"
        )
    return parts[0] if len(parts) == 1 else Union(*parts)


def _check_metric(store: Any, layout: str, metric: str) -> None:
    """``--keep-best --metric NAME`` where no checkpoint reports NAME would keep nothing by it:
    certainly a typo (``val_loss`` for ``loss``); say which metrics there are instead."""
    infos = list_checkpoints(store, layout)
    if not infos or any(metric in c.metrics for c in infos):
        return
    present = sorted({k for c in infos for k in c.metrics})
    have = ", ".join(present) if present else "none (no checkpoint reports any metric)"
    raise _Failure(
        f"no checkpoint in {store.url} reports the metric {metric!r} (--metric); metrics "
        f"found: {have}"
    )


class _EnginePins:
    """What live engines protect on a local root (``engine.protect``, pinfile.py): read
    before the plan, and again before each deletion (a protect while this process read)."""

    def __init__(self, store: Any) -> None:
        self.root = store.root if isinstance(store, LocalStore) else None
        self.seen: dict[int, list[tuple[int, int]]] = (
            pinfile.live_pins(self.root) if self.root is not None else {}
        )

    @contextlib.contextmanager
    def deleting(self) -> Iterator[Container[int]]:
        if self.root is None:
            yield ()
            return
        with pinfile.deleting(self.root) as now:
            for step, who in now.items():
                self.seen.setdefault(step, who)
            yield now

    def of(self, kept: Iterable[int]) -> dict[int, list[tuple[int, int]]]:
        return {s: self.seen[s] for s in sorted(kept) if s in self.seen}


def _run_prune(args: argparse.Namespace, console: Console) -> int:
    policy = _policy(args)
    store, layout = _open(args)
    if args.keep_best is not None:
        _check_metric(store, layout, args.metric)
    engines = _EnginePins(store)
    with _progress() as bar:
        result = prune(
            store,
            layout,
            policy,
            pinned=engines.seen,
            dry_run=args.dry_run,
            allow_tracker_lag=args.allow_tracker_lag,
            verify=not args.no_verify,
            progress=bar,
            warn=False,  # printed below, on stderr
            deleting=engines.deleting,
        )
    pinned = engines.of(result.kept)
    err = Console(stderr=True, markup=False, soft_wrap=True)
    for message in result.warnings.values():
        err.print(f"warning: {message}", style="yellow")
    cleaned: list[str] = []
    live: list[str] = []
    if args.clean_leftovers and not args.dry_run:
        live = _live_writers(store)
        if live:  # its temporaries look exactly like leftovers: removing them fails its save
            err.print(
                f"error: not removing leftovers: a live engine holds {store.url}'s locks "
                f"({', '.join(live)}); its saves in flight are temporaries too. Stop it first "
                "(each engine removes the leftovers of a crash itself when it starts)",
                style="red",
            )
        else:
            cleaned = store.clean_leftovers(layout)
    verb = "would delete" if args.dry_run else "deleted"
    if args.json:
        out = {
            "policy": repr(policy),
            "dry_run": args.dry_run,
            "deleted": result.deleted,
            "would_delete": result.deleted if args.dry_run else [],
            "already_gone": result.gone,
            "kept": {str(k): v for k, v in result.kept.items()},
            "errors": {str(k): v for k, v in result.errors.items()},
            "cleaned": cleaned,
            "clean_refused_live_locks": live,
            "protected_by_engines": {
                str(step): [{"rank": r, "pid": pid} for r, pid in who]
                for step, who in pinned.items()
            },
            "corrupt": {str(k): v for k, v in result.corrupt.items()},
            "warnings": list(result.warnings.values()),
        }
        console.print_json(json.dumps(out))
    else:
        rows = [(str(s), ", ".join(r)) for s, r in result.kept.items()]
        console.print(f"policy: {policy!r}")
        console.print(_table("kept", rows, ("step", "why")))
        for step, who in pinned.items():
            holders = "; ".join(f"rank {r}, pid {pid}" for r, pid in who)
            console.print(f"protected by a live engine: step {step} ({holders})")
        console.print(f"{verb}: {', '.join(map(str, result.deleted)) or 'nothing'}")
        if result.gone:  # a race with the engine's own prune: done, not an error
            console.print(
                f"already gone (deleted meanwhile by another process, e.g. the engine): "
                f"{', '.join(map(str, result.gone))}"
            )
        for name in cleaned:
            console.print(f"removed leftover: {name}")
        for step, msg in result.errors.items():
            console.print(f"error deleting step {step}: {msg}", style="red")
    return 1 if result.errors or live else 0


def _live_writers(store: Any) -> list[str]:
    """The locks a live engine holds on a local root (none known for an object store)."""
    from asyncckpt.storage.local import LocalStore
    from asyncckpt.storage.localfs import held_locks

    return held_locks(store.root) if isinstance(store, LocalStore) else []


@subcommand
def _add_start_fresh(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "start-fresh",
        help="after every checkpoint of a root was quarantined: let the next run start from "
        "step 0 on purpose",
        description="When every checkpoint of a root was found damaged and quarantined, the "
        "engine's load_latest raises instead of starting from step 0 in silence. This marks "
        "the quarantined checkpoints as seen (a note beside each), so that the next load "
        "starts from scratch, saying so in its log. Nothing is moved or deleted; `ls` still "
        "lists them. Refused while an engine runs on the root.",
    )
    p.add_argument("root", help="checkpoint root (a local or mounted path)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_run_start_fresh)


def _run_start_fresh(args: argparse.Namespace, console: Console) -> int:
    from asyncckpt.storage.fresh_start import start_fresh
    from asyncckpt.storage.localfs import held_locks

    root = Path(args.root)
    if not root.is_dir():
        raise _Failure(f"{root}: no such directory")
    live = held_locks(root)
    if live:  # its own load decides; a note written under it would race its quarantine
        raise _Failure(
            f"not starting {root} fresh: a live engine holds its locks ({', '.join(live)}); "
            "stop it first"
        )
    settled = start_fresh(root)
    if args.json:
        console.print_json(json.dumps({"root": str(root), "settled": [str(p) for p in settled]}))
        return 0
    if not settled:
        console.print(f"{root}: nothing is quarantined; nothing to do")
        return 0
    for path in settled:
        console.print(f"settled: {path}")
    console.print(f"the next load_latest on {root} starts from scratch")
    return 0


@subcommand
def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check every checkpoint against its manifest checksums, and the tracker "
        "(exit 1 if anything is bad)",
    )
    _add_root(p)
    p.set_defaults(func=_run_verify)


def _tracker_problem(store: Any, tracker: int | None, steps: set[int]) -> str | None:
    if tracker is None:
        return f"{L.TRACKER} is not a step number" if store.has_tracker() else None
    if tracker not in steps:
        return f"{L.TRACKER} names step {tracker}, which is not committed"
    return None


def _run_verify(args: argparse.Namespace, console: Console) -> int:
    store, layout = _open(args)
    infos, problems, names = _checked(store, layout, quick=False)
    if not infos and not args.json:
        raise _Failure(_no_checkpoints(store, args.root, layout))
    checkpoints = [
        {
            "step": c.step,
            "path": store.url_of(names[c.step]),
            "ok": not problems[c.step],
            "problems": problems[c.step],
        }
        for c in infos
    ]
    tracker = store.read_tracker()
    code = _print_verify(
        args, console, store.url, layout, checkpoints, tracker,
        _tracker_problem(store, tracker, {c.step for c in infos}), store.leftovers(layout),
        quarantined=_quarantined(store, layout),
    )  # fmt: skip
    if not infos:
        raise _Failure(_no_checkpoints(store, args.root, layout))
    return code


def _print_verify(
    args: argparse.Namespace,
    console: Console,
    root: str,
    layout: str,
    checkpoints: list[dict[str, Any]],
    tracker: int | None,
    tracker_problem: str | None,
    leftovers: list[str],
    quarantined: list[dict[str, Any]] | None = None,
) -> int:
    """``verify``'s output for any tier: JSON, or a table, the tracker and a verdict.
    ``quarantined`` (local roots): shown, not verified and not counted in the verdict."""
    good = [c["step"] for c in checkpoints if c["ok"]]
    ok = len(good) == len(checkpoints) and tracker_problem is None
    if args.json:
        out = {
            "root": root,
            "layout": layout,
            "ok": ok,
            "checkpoints": checkpoints,
            "tracker": tracker,
            "tracker_problem": tracker_problem,
            "newest_good": good[-1] if good else None,
            "leftovers": leftovers,
            "quarantined": quarantined or [],
        }
        console.print_json(json.dumps(out))
        return 0 if ok else 1
    rows = [
        (str(c["step"]), "ok" if c["ok"] else "BAD", "; ".join(c["problems"])) for c in checkpoints
    ]
    console.print(_table(f"{args.root} ({layout})", rows, ("step", "status", "problems")))
    if tracker_problem:
        console.print(f"tracker: BAD: {tracker_problem}", style="red")
    else:
        console.print(f"tracker: {tracker}")
    if leftovers:
        console.print(
            "leftovers (an engine at work, or a crash; removed at the next start): "
            + ", ".join(leftovers)
        )
    _print_quarantined(console, quarantined or [])
    if ok:
        console.print(f"OK: {len(good)} checkpoint(s) verified")
        return 0
    newest = f"; newest good: step {good[-1]}" if good else "; no good checkpoint"
    bad = len(checkpoints) - len(good)
    console.print(f"BAD: {bad} of {len(checkpoints)} checkpoint(s) failed{newest}", style="red")
    return 1


@subcommand
def _add_stats(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stats",
        help="per-save figures recorded in the manifests: stall, write time, throughput, size",
        description="Show the figures each save recorded in its manifest: how long training "
        "was blocked (stall = stage + wait + alloc), how long the background write took, its "
        "throughput, the time its writes were paused, and the size; then the median and p90 "
        "stall, median throughput and total size. Checkpoints written before asyncckpt "
        "recorded figures show '-'. --plot writes a PNG (needs matplotlib: the bench extra).",
    )
    _add_root(p)
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="also write a plot of stall and write time vs step, and throughput, to this file",
    )
    p.set_defaults(func=_run_stats)


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{_human(int(x))}/s"


def _run_stats(args: argparse.Namespace, console: Console) -> int:
    from asyncckpt.stats import plot_stats, read_stats, summarize

    store, layout = _open(args)
    if isinstance(store, LocalStore):
        records = read_stats(args.root, layout)
    else:
        records = _url_stats(store, layout)
    if not records:
        raise _Failure(_no_checkpoints(store, args.root, layout))
    summary = summarize(records)
    plotted = None
    if args.plot:
        try:
            plotted = plot_stats(records, args.plot, title=f"{args.root} ({layout})")
        except ImportError as e:
            raise _Failure(f"--plot: {e}") from e
        except ValueError as e:
            raise _Failure(f"--plot: {args.root}: {e}") from e
    if args.json:
        out = {
            "root": str(args.root),
            "layout": layout,
            "checkpoints": [r.as_dict() for r in records],
            "summary": summary,
            "plot": None if plotted is None else str(plotted),
        }
        console.print_json(json.dumps(out))
        return 0
    rows = [
        (
            _step_label(r.step, r.tier, r.persisted_because),
            "-" if r.committed_at is None else _when(r.committed_at),
            "-" if r.bytes is None else _human(r.bytes),
            _seconds(r.blocked_seconds),
            _seconds(r.write_seconds),
            _rate(r.throughput_bytes_per_s),
            _seconds(r.paused_seconds),
        )
        for r in records
    ]
    cols = ("step", "committed", "size", "stall", "write", "throughput", "paused")
    console.print(_table(f"{args.root} ({layout})", rows, cols))
    for r in records:
        if r.error:
            console.print(f"step {r.step}: {r.error}", style="yellow")
    s = summary
    console.print(
        f"{s['checkpoints']} checkpoint(s), {s['with_figures']} with figures;  "
        f"median stall {_seconds(s['median_stall_seconds'])}  "
        f"p90 stall {_seconds(s['p90_stall_seconds'])}  "
        f"median throughput {_rate(s['median_throughput_bytes_per_s'])}  "
        f"total {_human(s['total_bytes'])}"
    )
    if plotted is not None:
        console.print(f"plot written to {plotted}")
    return 0


def _url_stats(store: Any, layout: str) -> list:
    """The recorded figures of a URL root's committed checkpoints (their manifests only)."""
    from asyncckpt.stats import RecordedStats, record_from_manifest

    records = []
    for c in store.committed(layout):
        where = store.url_of(c.name)  # a URL, not a Path: Path() would lose a '/'
        try:
            manifest = store.read_manifest(c.name)
        except (OSError, ValueError) as e:
            records.append(RecordedStats(c.step, where, error=f"manifest unreadable: {e}"))
            continue
        if not isinstance(manifest, dict):
            records.append(RecordedStats(c.step, where, error="manifest is not an object"))
            continue
        records.append(record_from_manifest(c.step, where, manifest))
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m asyncckpt",
        description="Inspect, verify and prune asyncckpt checkpoint roots.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 error, 2 bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    # markup off: paths, metric names and errors are printed as they are, brackets included.
    console = Console(width=None if sys.stdout.isatty() else 160, markup=False)
    err = Console(stderr=True, markup=False, soft_wrap=True)
    try:
        return args.func(args, console)
    except _UsageError as e:
        parser.print_usage(sys.stderr)
        err.print(f"error: {e}")
        return 2
    except (_Failure, CheckpointError, OSError, ValueError) as e:
        err.print(f"error: {e}")
        return 1
