"""``python -m asyncckpt ls | verify | prune | stats | start-fresh ROOT``: inspect, check and prune any root the engine wrote.

Each subcommand is a function that adds its parser and sets ``func`` (``(args, console) ->
exit code``), registered in order below (``subcommand`` registers another). Exit codes: 0 ok,
1 error, 2 bad usage. One module per command family:

- ``common``: the registry, the errors, the root argument and its store, shared formatting.
- ``listing``: ``ls`` and ``stats``.
- ``prune``: ``prune``.
- ``start_fresh``: ``start-fresh``.
- ``verify``: ``verify``.

Nothing here imports torch (``python -m asyncckpt --help`` answers at once): the CLI reads
manifests and file checksums only. Long reads show a progress bar on stderr when it is a
terminal (``asyncckpt.core.progress.RichProgress``); pipes and files get none.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from asyncckpt.cli.common import SUBCOMMANDS, Failure, UsageError, subcommand
from asyncckpt.cli.listing import add_ls, add_stats
from asyncckpt.cli.prune import add_prune
from asyncckpt.cli.start_fresh import add_start_fresh
from asyncckpt.cli.verify import add_verify
from asyncckpt.errors import CheckpointError

__all__ = ["main", "build_parser", "subcommand"]

# The order ``--help`` lists them in.
for _add in (add_ls, add_prune, add_start_fresh, add_verify, add_stats):
    subcommand(_add)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m asyncckpt",
        description="Inspect, verify and prune asyncckpt checkpoint roots.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
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
    except UsageError as e:
        parser.print_usage(sys.stderr)
        err.print(f"error: {e}")
        return 2
    except (Failure, CheckpointError, OSError, ValueError) as e:
        err.print(f"error: {e}")
        return 1
