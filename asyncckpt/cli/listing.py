"""``ls`` and ``stats``: what a root holds (each checkpoint, what protects it, what is under
way beside it, what was quarantined) and the figures each save recorded.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.console import Console

from asyncckpt.cli.common import (
    Failure,
    add_root,
    check_all,
    human,
    local_time,
    make_table,
    metrics_text,
    no_checkpoints,
    open_root,
    print_quarantined,
    quarantined_entries,
    step_label,
)
from asyncckpt.core import layout as L
from asyncckpt.retention import (
    CheckpointInfo,
    plan_prune,
)
from asyncckpt.stats import RecordedStats, plot_stats, read_stats, record_from_manifest, summarize
from asyncckpt.storage import pinfile
from asyncckpt.storage.base import Store
from asyncckpt.storage.goodput import Ledger, read_ledger
from asyncckpt.storage.local import LocalStore, tree_size
from asyncckpt.storage.prune import disk_usage
from asyncckpt.storage.remote import pending_uploads


def add_ls(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ls",
        help="list committed checkpoints, which are protected, leftovers, quarantined ones",
        description="List committed checkpoints: step, commit time, size, metrics, status, "
        "what protects them. The status column ('ok' or 'CORRUPT: reason') compares every "
        "file's size with the manifest by default (fast, reads no data: catches missing and "
        "truncated shards); --verify also reads every byte and checks its checksum (as `verify`). "
        "Checkpoints a load found corrupt, moved into ROOT/.quarantine/, are listed after them.",
    )
    add_root(p)
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every file's checksum, not only its size (reads the whole root)",
    )
    p.set_defaults(func=run_ls)


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


def _ls_rows(entries: list[dict]) -> list[tuple[str, ...]]:
    return [
        (
            step_label(e["step"], e.get("tier"), e.get("persisted_because")),
            local_time(e["committed_at"]),
            human(e["bytes"]),
            metrics_text(e["metrics"]),
            json.dumps(e["metadata"], separators=(",", ":")) if e["metadata"] else "",
            e["status"],
            ", ".join(e["protected"]),
        )
        for e in entries
    ]


def _usage(store: Store, layout: str, infos: list[CheckpointInfo]) -> dict[str, int]:
    """The root's measured bytes; ``linked_bytes``: what hard links between checkpoints (a
    differential save's unchanged files) share, counted in each row but once in the total."""
    if isinstance(store, LocalStore):
        usage = disk_usage(store.root, layout)
        every = sum(tree_size(c.path) for c in L.scan(store.root, layout))
        return {**usage, "linked_bytes": max(0, every - usage["committed_bytes"])}
    return {
        "committed_bytes": sum(c.size_bytes for c in infos),
        "checkpoints": len(infos),
        "linked_bytes": 0,  # an object store has no hard links
    }


def run_ls(args: argparse.Namespace, console: Console) -> int:
    store, layout = open_root(args)
    quick = not args.verify
    infos, problems, _ = check_all(store, layout, quick)
    tracker = store.read_tracker()
    pinned = pinfile.live_pins(store.root) if isinstance(store, LocalStore) else {}
    protected = plan_prune(infos, None, tracker_step=tracker, pinned=pinned).keep
    writes, leftovers, pending = _background(store, layout)
    usage = _usage(store, layout, infos)
    entries = _ls_entries(infos, problems, protected)
    quarantined = quarantined_entries(store, layout)
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
    console.print(make_table(f"{args.root} ({layout})", rows, cols))
    if not infos:
        console.print(no_checkpoints(store, args.root, layout))
    line = f"tracker: {tracker}  committed: {human(usage['committed_bytes'])}"
    if usage["linked_bytes"]:
        line += (
            f" ({human(usage['linked_bytes'])} shared by hard links between checkpoints: "
            "in the size of each row, once in this total)"
        )
    if "free_bytes" in usage:
        line += f"  leftovers: {human(usage['leftover_bytes'])}  free: {human(usage['free_bytes'])}"
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
    print_quarantined(console, quarantined)
    return 0


def _background(store: Store, layout: str) -> tuple[list[dict], list[str], dict[str, Any] | None]:
    """What is under way beside the committed checkpoints: temporaries whose writer still runs
    (``LocalStore.writes``), the leftovers of writers that are gone (names), and the uploads
    a remote tier has not published yet (``remote.pending_uploads``; local roots only)."""
    if not isinstance(store, LocalStore):
        return [], store.leftovers(layout), None
    writes = store.writes()
    live = [w for w in writes if w["state"] != "leftover"]
    dead = [w["name"] for w in writes if w["state"] == "leftover"]
    return live, dead, pending_uploads(store.root, layout)


def _write_line(w: dict[str, Any]) -> str:
    """``in progress: step 130 (memory: trainer died) by pid 4242 on host h, rank 0, 2.1 s``."""
    if "step" not in w:  # (noted, but unreadable: being written this instant)
        return f"in progress: {w['name']}"
    label = step_label(w["step"], w.get("tier"), w.get("persisted_because"))
    since = f", for {time.time() - w['started_at']:.1f} s" if w.get("started_at") else ""
    ranks = w.get("ranks") or [w.get("rank", 0)]
    who = f"pid {w.get('pid')} on host {w.get('host')}, rank {', '.join(map(str, ranks))}"
    if w["state"] == "unknown":
        return (
            f"in progress?: step {label} by {who} (another host: not checked){since}: {w['name']}"
        )
    return f"in progress: step {label} by {who}{since}: {w['name']}"


def add_stats(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stats",
        help="per-save figures recorded in the manifests: stall, write time, throughput, size",
        description="Show the figures each save recorded in its manifest: how long training "
        "was blocked (stall = stage + wait + alloc), how long the background write took, its "
        "throughput, the time its writes were paused, and the size; then the median and p90 "
        "stall, median throughput and total size. Checkpoints written before asyncckpt "
        "recorded figures show '-'. Then the goodput ledger, where the root has one: each "
        "run's wall time split into productive time, save blocking, load, start-up and "
        "wasted progress (steps a restart repeated). --plot writes a PNG (needs matplotlib: "
        "the bench extra).",
    )
    add_root(p)
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="also write a plot of stall and write time vs step, and throughput, to this file",
    )
    p.set_defaults(func=run_stats)


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{human(int(x))}/s"


def run_stats(args: argparse.Namespace, console: Console) -> int:
    store, layout = open_root(args)
    if isinstance(store, LocalStore):
        records = read_stats(args.root, layout)
    else:
        records = _url_stats(store, layout)
    if not records:
        raise Failure(no_checkpoints(store, args.root, layout))
    summary = summarize(records)
    ledger = read_ledger(store.root) if isinstance(store, LocalStore) else None
    plotted = None
    if args.plot:
        try:
            plotted = plot_stats(records, args.plot, title=f"{args.root} ({layout})")
        except ImportError as e:
            raise Failure(f"--plot: {e}") from e
        except ValueError as e:
            raise Failure(f"--plot: {args.root}: {e}") from e
    if args.json:
        out = {
            "root": str(args.root),
            "layout": layout,
            "checkpoints": [r.as_dict() for r in records],
            "summary": summary,
            "plot": None if plotted is None else str(plotted),
            "goodput": None if ledger is None else ledger.as_dict(),
        }
        console.print_json(json.dumps(out))
        return 0
    rows = [
        (
            step_label(r.step, r.tier, r.persisted_because),
            "-" if r.committed_at is None else local_time(r.committed_at),
            "-" if r.bytes is None else human(r.bytes),
            _seconds(r.blocked_seconds),
            _seconds(r.write_seconds),
            _rate(r.throughput_bytes_per_s),
            _seconds(r.paused_seconds),
        )
        for r in records
    ]
    cols = ("step", "committed", "size", "stall", "write", "throughput", "paused")
    console.print(make_table(f"{args.root} ({layout})", rows, cols))
    for r in records:
        if r.error:
            console.print(f"step {r.step}: {r.error}", style="yellow")
    s = summary
    console.print(
        f"{s['checkpoints']} checkpoint(s), {s['with_figures']} with figures;  "
        f"median stall {_seconds(s['median_stall_seconds'])}  "
        f"p90 stall {_seconds(s['p90_stall_seconds'])}  "
        f"median throughput {_rate(s['median_throughput_bytes_per_s'])}  "
        f"total {human(s['total_bytes'])}"
    )
    if ledger is not None:
        _print_goodput(ledger, console)
    if plotted is not None:
        console.print(f"plot written to {plotted}")
    return 0


def _print_goodput(ledger: Ledger, console: Console) -> None:
    """The goodput ledger (storage/goodput.py): seconds per category, per run and in all."""
    rows = [
        (
            local_time(r.started_at),
            f"{r.wall_seconds:.1f}s",
            f"{r.productive_seconds:.1f}s",
            f"{r.save_blocking_seconds:.1f}s",
            f"{r.load_seconds:.1f}s",
            f"{r.startup_seconds:.1f}s",
            f"{r.wasted_seconds:.1f}s ({r.wasted_steps} steps)",
            "-" if r.resumed_step is None else str(r.resumed_step),
            "closed" if r.closed else "died or running",
        )
        for r in ledger.runs
    ]
    cols = ("run started", "wall", "productive", "save blocking", "load", "start-up",
            "wasted", "resumed", "end")  # fmt: skip
    console.print(make_table("goodput ledger", rows, cols))
    t = ledger.as_dict()["total"]
    share = "-" if t["goodput"] is None else f"{t['goodput']:.1%}"
    console.print(
        f"goodput {share} over {t['runs']} run(s): productive {t['productive_seconds']:.1f}s of "
        f"{t['wall_seconds']:.1f}s; save blocking {t['save_blocking_seconds']:.1f}s, load "
        f"{t['load_seconds']:.1f}s, start-up {t['startup_seconds']:.1f}s, wasted "
        f"{t['wasted_seconds']:.1f}s ({t['wasted_steps']} steps); between runs "
        f"{t['down_seconds']:.1f}s"
    )


def _url_stats(store: Store, layout: str) -> list:
    """The recorded figures of a URL root's committed checkpoints (their manifests only)."""
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
