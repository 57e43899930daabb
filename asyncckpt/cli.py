"""``python -m asyncckpt ls | verify | prune | stats ROOT``: inspect, check and prune any root the engine wrote.

Each subcommand is one function decorated with ``@subcommand``: it adds its parser and sets
``func`` (``(args, console) -> exit code``). Exit codes: 0 ok, 1 error, 2 bad usage.

Nothing here imports torch (``python -m asyncckpt --help`` answers at once): the CLI reads
manifests and file checksums only. Long reads show a progress bar on stderr when it is a
terminal (``asyncckpt.progress.RichProgress``); pipes and files get none.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from asyncckpt import layout as L
from asyncckpt.errors import CheckpointError
from asyncckpt.paths import check_local_root, is_url
from asyncckpt.progress import RichProgress
from asyncckpt.prune import (
    clean_leftovers,
    detect_layout,
    disk_usage,
    list_checkpoints,
    list_quarantined,
    prune,
)
from asyncckpt.retention import (
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    RetentionPolicy,
    Union,
    plan_prune,
)

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


def _store(args: argparse.Namespace) -> Any:
    """The ``FsspecStore`` of a URL root (``--storage-option`` parsed), or a clear error."""
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
    try:
        store = FsspecStore(args.root, options)
        bucket = store.base.split("/")[0]  # reach it now: a wrong bucket or endpoint fails here
        if not store.fs.exists(bucket):
            raise _Failure(f"no such bucket (or no access to it): {bucket} of {args.root}")
    except UploadFailed as e:
        raise _Failure(str(e)) from e
    except (OSError, ValueError) as e:
        raise _Failure(f"cannot read {args.root}: {e}") from e
    return store


def _remote_layout(args: argparse.Namespace, store: Any) -> str:
    return store.detect_layout() if args.layout == "auto" else args.layout


def _layout(args: argparse.Namespace) -> str:
    root = check_local_root(args.root)  # an s3:// URL is refused, not taken for a directory
    if not root.exists():
        raise _Failure(f"no such directory: {args.root}")
    if not root.is_dir():
        raise _Failure(f"not a directory: {args.root}")
    return detect_layout(args.root) if args.layout == "auto" else args.layout


def _no_checkpoints(root: str, layout: str) -> str:
    """Why a root shows no checkpoint, with a hint when the other layout's names are there."""
    msg = f"no checkpoints found in {root} (layout {layout})"
    others = [lay for lay in L.LAYOUTS if lay != layout and L.scan(root, lay)]
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


def _table(title: str, rows: list[tuple[str, ...]], columns: Sequence[str]) -> Table:
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


def _quarantined(root: str, layout: str) -> list[dict[str, Any]]:
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
        for q in list_quarantined(root, layout)
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


def _run_ls(args: argparse.Namespace, console: Console) -> int:
    from asyncckpt.manifest import verify

    if is_url(args.root):
        return _run_ls_url(args, console)
    layout = _layout(args)
    infos = list_checkpoints(args.root, layout)
    with _progress() as bar:
        report = verify(args.root, layout, quick=not args.verify, progress=bar)
    problems: dict[int, list[str]] = {c.step: c.problems for c in report.checkpoints}
    tracker = L.read_tracker(args.root)
    protected = plan_prune(infos, None, tracker_step=tracker).keep
    leftovers = sorted(e for e in os.listdir(args.root) if L.is_leftover(e))
    usage = disk_usage(args.root, layout)
    entries = _ls_entries(infos, problems, protected)
    quarantined = _quarantined(args.root, layout)
    if args.json:
        out = {
            "layout": layout,
            "tracker": tracker,
            "checkpoints": entries,
            "leftovers": leftovers,
            "quarantined": quarantined,
            "usage": usage,
            "checked": "sizes" if report.quick else "checksums",
        }
        console.print_json(json.dumps(out))
        return 0
    rows = _ls_rows(entries)
    checked = "sizes" if report.quick else "checksums"
    cols = ("step", "committed", "size", "metrics", "metadata", f"status ({checked})", "protected")
    console.print(_table(f"{args.root} ({layout})", rows, cols))
    if not infos:
        console.print(_no_checkpoints(args.root, layout))
    console.print(
        f"tracker: {tracker}  committed: {_human(usage['committed_bytes'])}  "
        f"leftovers: {_human(usage['leftover_bytes'])}  free: {_human(usage['free_bytes'])}"
    )
    if tracker is not None and tracker not in {c.step for c in infos}:
        console.print(
            f"warning: the tracker names step {tracker}, which is not here", style="yellow"
        )
    for name in leftovers:
        console.print(f"leftover: {name}")
    _print_quarantined(console, quarantined)
    return 0


@subcommand
def _add_prune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prune",
        help="delete checkpoints a retention policy does not keep",
        description="Delete the checkpoints a retention policy does not keep (never the newest, "
        "nor the one the tracker names). Before deleting anything, the kept checkpoints are "
        "checked against their manifests (every byte, newest first, until one verifies); if "
        "none does, the newest one that verifies is kept too ('newest that verifies'), and if "
        "nothing verifies nothing is deleted. --no-verify skips that read.",
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
        help="also remove temporaries and trash (only when no engine writes to ROOT)",
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


def _check_metric(root: str, layout: str, metric: str) -> None:
    """``--keep-best --metric NAME`` where no checkpoint reports NAME would keep nothing by it:
    certainly a typo (``val_loss`` for ``loss``); say which metrics there are instead."""
    infos = list_checkpoints(root, layout)
    if not infos or any(metric in c.metrics for c in infos):
        return
    present = sorted({k for c in infos for k in c.metrics})
    have = ", ".join(present) if present else "none (no checkpoint reports any metric)"
    raise _Failure(
        f"no checkpoint in {root} reports the metric {metric!r} (--metric); metrics found: {have}"
    )


def _run_prune(args: argparse.Namespace, console: Console) -> int:
    policy = _policy(args)
    if is_url(args.root):
        return _run_prune_url(args, console, policy)
    layout = _layout(args)
    if args.keep_best is not None:
        _check_metric(args.root, layout, args.metric)
    with _progress() as bar:
        result = prune(
            args.root,
            layout,
            policy,
            dry_run=args.dry_run,
            allow_tracker_lag=args.allow_tracker_lag,
            verify=not args.no_verify,
            progress=bar,
            warn=False,  # printed below, on stderr
        )
    err = Console(stderr=True, markup=False, soft_wrap=True)
    for message in result.warnings.values():
        err.print(f"warning: {message}", style="yellow")
    cleaned = clean_leftovers(args.root) if args.clean_leftovers and not args.dry_run else []
    verb = "would delete" if args.dry_run else "deleted"
    if args.json:
        out = {
            "policy": repr(policy),
            "dry_run": args.dry_run,
            "deleted": result.deleted,
            "already_gone": result.gone,
            "kept": {str(k): v for k, v in result.kept.items()},
            "errors": {str(k): v for k, v in result.errors.items()},
            "cleaned": cleaned,
            "corrupt": {str(k): v for k, v in result.corrupt.items()},
            "warnings": list(result.warnings.values()),
        }
        console.print_json(json.dumps(out))
    else:
        rows = [(str(s), ", ".join(r)) for s, r in result.kept.items()]
        console.print(f"policy: {policy!r}")
        console.print(_table("kept", rows, ("step", "why")))
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
    return 1 if result.errors else 0


@subcommand
def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check every checkpoint against its manifest checksums, and the tracker "
        "(exit 1 if anything is bad)",
    )
    _add_root(p)
    p.set_defaults(func=_run_verify)


def _run_verify(args: argparse.Namespace, console: Console) -> int:
    from asyncckpt.manifest import verify

    if is_url(args.root):
        return _run_verify_url(args, console)
    layout = _layout(args)
    with _progress() as bar:
        report = verify(args.root, layout, progress=bar)
    if not report.checkpoints and not args.json:
        raise _Failure(_no_checkpoints(args.root, layout))
    checkpoints = [
        {"step": c.step, "path": str(c.path), "ok": c.ok, "problems": c.problems}
        for c in report.checkpoints
    ]
    code = _print_verify(
        args, console, str(report.root), report.layout, checkpoints,
        report.tracker_step, report.tracker_problem, report.leftovers,
        quarantined=_quarantined(args.root, layout),
    )  # fmt: skip
    if not report.checkpoints:
        raise _Failure(_no_checkpoints(args.root, layout))
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


# ------------------------------------------------------------------ URL roots (object stores)
# A checkpoint there is committed exactly when its marker exists (storage/fsspec_store.py):
# these list, check and prune only those; prefixes without one are shown as leftovers.


def _url_rows(args: argparse.Namespace, quick: bool) -> tuple[Any, str, list, dict, int | None]:
    from asyncckpt.storage.remote import remote_infos

    store = _store(args)
    layout = _remote_layout(args, store)
    infos = remote_infos(store, layout)
    with _progress() as bar:
        bar.begin(
            "checking" if quick else "verifying", sum(c.size_bytes for c in infos), len(infos)
        )
        problems = {}
        for c in infos:
            problems[c.step] = store.check(L.dir_name(layout, c.step), bar.advance, quick=quick)
            bar.checkpoint_done(c.step, not problems[c.step])
        bar.end()
    return store, layout, infos, problems, store.read_tracker()


def _run_ls_url(args: argparse.Namespace, console: Console) -> int:
    store, layout, infos, problems, tracker = _url_rows(args, quick=not args.verify)
    protected = plan_prune(infos, None, tracker_step=tracker).keep
    leftovers = store.leftovers(layout)
    checked = "checksums" if args.verify else "sizes"
    entries = _ls_entries(infos, problems, protected)
    if args.json:
        out = {
            "root": args.root,
            "layout": layout,
            "tracker": tracker,
            "checkpoints": entries,
            "leftovers": leftovers,
            "checked": checked,
        }
        console.print_json(json.dumps(out))
        return 0
    rows = _ls_rows(entries)
    cols = ("step", "committed", "size", "metrics", "metadata", f"status ({checked})", "protected")
    console.print(_table(f"{args.root} ({layout})", rows, cols))
    if not infos:
        console.print(f"no committed checkpoints in {args.root} (layout {layout})")
    console.print(f"tracker: {tracker}  committed: {_human(sum(c.size_bytes for c in infos))}")
    for name in leftovers:
        console.print(f"leftover (no commit marker): {name}")
    return 0


def _run_verify_url(args: argparse.Namespace, console: Console) -> int:
    store, layout, infos, problems, tracker = _url_rows(args, quick=False)
    if not infos:
        raise _Failure(f"no committed checkpoints in {args.root} (layout {layout})")
    steps = {c.step for c in infos}
    tracker_problem = (
        None
        if tracker in steps
        else f"names step {tracker}, which is not committed there"
        if tracker is not None
        else "missing"
    )
    checkpoints = [
        {"step": c.step, "ok": not problems[c.step], "problems": problems[c.step]} for c in infos
    ]
    return _print_verify(
        args, console, args.root, layout, checkpoints, tracker, tracker_problem,
        store.leftovers(layout),
    )  # fmt: skip


def _run_prune_url(args: argparse.Namespace, console: Console, policy: RetentionPolicy) -> int:
    from asyncckpt.storage.remote import remote_infos

    store = _store(args)
    layout = _remote_layout(args, store)
    infos = remote_infos(store, layout)
    if args.keep_best is not None and infos and not any(args.metric in c.metrics for c in infos):
        present = sorted({k for c in infos for k in c.metrics}) or "none"
        raise _Failure(
            f"no checkpoint in {args.root} reports the metric {args.metric!r} (--metric); "
            f"metrics found: {present}"
        )
    tracker = store.read_tracker()
    newest = max((c.step for c in infos), default=None)
    if tracker != newest and not args.allow_tracker_lag:
        raise _Failure(
            f"the tracker of {args.root} names step {tracker}, not the newest ({newest}): an "
            "upload may be in progress; pass --allow-tracker-lag if none is"
        )
    plan = plan_prune(infos, policy, tracker_step=tracker)
    if plan.delete and not args.no_verify and not args.dry_run:
        # Never delete while no kept checkpoint is good: read the kept ones, newest first.
        kept = sorted(plan.keep, reverse=True)
        with _progress() as bar:
            if not any(not store.check(L.dir_name(layout, s), bar.advance) for s in kept):
                raise _Failure(
                    f"no kept checkpoint in {args.root} verifies ({kept}); deleted nothing"
                )
    deleted = []
    if not args.dry_run:
        for s in plan.delete:
            store.delete(L.dir_name(layout, s))
            deleted.append(s)
    cleaned = store.clean_leftovers(layout) if args.clean_leftovers and not args.dry_run else []
    verb = "would delete" if args.dry_run else "deleted"
    if args.json:
        out = {
            "policy": repr(policy),
            "dry_run": args.dry_run,
            "deleted": deleted,
            "would_delete": plan.delete if args.dry_run else [],
            "kept": {str(k): v for k, v in plan.keep.items()},
            "cleaned": cleaned,
        }
        console.print_json(json.dumps(out))
        return 0
    console.print(f"policy: {policy!r}")
    rows = [(str(s), ", ".join(r)) for s, r in plan.keep.items()]
    console.print(_table("kept", rows, ("step", "why")))
    console.print(f"{verb}: {', '.join(map(str, plan.delete)) or 'nothing'}")
    for name in cleaned:
        console.print(f"removed leftover: {name}")
    return 0


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

    if is_url(args.root):
        layout, records = _url_stats(args)
    else:
        layout = _layout(args)
        records = read_stats(args.root, layout)
    if not records:
        if is_url(args.root):
            raise _Failure(f"no committed checkpoints in {args.root} (layout {layout})")
        raise _Failure(_no_checkpoints(args.root, layout))
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


def _url_stats(args: argparse.Namespace) -> tuple[str, list]:
    """The recorded figures of a URL root's committed checkpoints (their manifests only)."""
    from asyncckpt.stats import RecordedStats, record_from_manifest

    store = _store(args)
    layout = _remote_layout(args, store)
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
    return layout, records


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
