"""``prune``: delete the checkpoints a retention policy does not keep, never one a live engine
protects, and (``--clean-leftovers``) what crashes left while no engine runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Container, Iterable, Iterator

from rich.console import Console

from asyncckpt.cli.common import (
    Failure,
    UsageError,
    add_root,
    make_table,
    open_root,
    progress_bar,
)
from asyncckpt.retention import (
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    RetentionPolicy,
    Union,
)
from asyncckpt.storage import pinfile
from asyncckpt.storage.base import Store
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.localfs import held_locks
from asyncckpt.storage.prune import list_checkpoints, prune


def add_prune(sub: argparse._SubParsersAction) -> None:
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
    add_root(p)
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
    p.set_defaults(func=run_prune)


def _policy(args: argparse.Namespace) -> RetentionPolicy:
    parts: list[RetentionPolicy] = []
    try:
        if args.keep_last is not None:
            parts.append(KeepLast(args.keep_last))
        if args.keep_best is not None:
            if not args.metric:
                raise UsageError("--keep-best needs --metric")
            parts.append(
                KeepBest(args.keep_best, args.metric, mode=args.mode, ties=args.ties or "newer")
            )
        elif args.metric:
            raise UsageError("--metric is only used with --keep-best")
        elif args.ties:
            raise UsageError("--ties is only used with --keep-best")
        if args.keep_every is not None:
            parts.append(KeepEvery(args.keep_every, exact=not args.not_exact))
        elif args.not_exact:
            raise UsageError("--not-exact is only used with --keep-every")
        if args.keep_interval is not None:
            parts.append(KeepInterval(args.keep_interval))
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e
    if not parts:
        raise UsageError("give a policy: --keep-last, --keep-best, --keep-every or --keep-interval")
    return parts[0] if len(parts) == 1 else Union(*parts)


def _check_metric(store: Store, layout: str, metric: str) -> None:
    """``--keep-best --metric NAME`` where no checkpoint reports NAME would keep nothing by it:
    certainly a typo (``val_loss`` for ``loss``); say which metrics there are instead."""
    infos = list_checkpoints(store, layout)
    if not infos or any(metric in c.metrics for c in infos):
        return
    present = sorted({k for c in infos for k in c.metrics})
    have = ", ".join(present) if present else "none (no checkpoint reports any metric)"
    raise Failure(
        f"no checkpoint in {store.url} reports the metric {metric!r} (--metric); metrics "
        f"found: {have}"
    )


class _EnginePins:
    """What live engines protect on a local root (``engine.protect``, pinfile.py): read
    before the plan, and again before each deletion (a protect while this process read)."""

    def __init__(self, store: Store) -> None:
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


def run_prune(args: argparse.Namespace, console: Console) -> int:
    policy = _policy(args)
    store, layout = open_root(args)
    if args.keep_best is not None:
        _check_metric(store, layout, args.metric)
    engines = _EnginePins(store)
    with progress_bar() as bar:
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
        console.print(make_table("kept", rows, ("step", "why")))
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


def _live_writers(store: Store) -> list[str]:
    """The locks a live engine holds on a local root (none known for an object store)."""
    return held_locks(store.root) if isinstance(store, LocalStore) else []
