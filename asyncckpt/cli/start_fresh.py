"""``start-fresh``: after every checkpoint of a root was quarantined, let the next run start
from step 0 on purpose (a note beside each; nothing moved).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from asyncckpt.cli.common import Failure, refuse_step_dir
from asyncckpt.storage.fresh_start import start_fresh
from asyncckpt.storage.localfs import held_locks


def add_start_fresh(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=run_start_fresh)


def run_start_fresh(args: argparse.Namespace, console: Console) -> int:
    root = Path(args.root)
    if not root.is_dir():
        raise Failure(f"{root}: no such directory")
    refuse_step_dir(root)
    live = held_locks(root)
    if live:  # its own load decides; a note written under it would race its quarantine
        raise Failure(
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
