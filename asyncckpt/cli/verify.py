"""``verify``: check every checkpoint of a root against its manifest's checksums, and the
tracker; exit 1 if anything is bad.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console

from asyncckpt.cli.common import (
    Failure,
    add_root,
    check_all,
    make_table,
    no_checkpoints,
    open_root,
    print_quarantined,
    quarantined_entries,
)
from asyncckpt.core import layout as L
from asyncckpt.storage.base import Store


def add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check every checkpoint against its manifest checksums, and the tracker "
        "(exit 1 if anything is bad)",
    )
    add_root(p)
    p.set_defaults(func=run_verify)


def _tracker_problem(store: Store, tracker: int | None, steps: set[int]) -> str | None:
    if tracker is None:
        return f"{L.TRACKER} is not a step number" if store.has_tracker() else None
    if tracker not in steps:
        return f"{L.TRACKER} names step {tracker}, which is not committed"
    return None


def run_verify(args: argparse.Namespace, console: Console) -> int:
    store, layout = open_root(args)
    infos, problems, names = check_all(store, layout, quick=False)
    if not infos and not args.json:
        raise Failure(no_checkpoints(store, args.root, layout))
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
        quarantined=quarantined_entries(store, layout),
    )  # fmt: skip
    if not infos:
        raise Failure(no_checkpoints(store, args.root, layout))
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
    console.print(make_table(f"{args.root} ({layout})", rows, ("step", "status", "problems")))
    if tracker_problem:
        console.print(f"tracker: BAD: {tracker_problem}", style="red")
    else:
        console.print(f"tracker: {tracker}")
    if leftovers:
        console.print(
            "leftovers (an engine at work, or a crash; removed at the next start): "
            + ", ".join(leftovers)
        )
    print_quarantined(console, quarantined or [])
    if ok:
        console.print(f"OK: {len(good)} checkpoint(s) verified")
        return 0
    newest = f"; newest good: step {good[-1]}" if good else "; no good checkpoint"
    bad = len(checkpoints) - len(good)
    console.print(f"BAD: {bad} of {len(checkpoints)} checkpoint(s) failed{newest}", style="red")
    return 1
