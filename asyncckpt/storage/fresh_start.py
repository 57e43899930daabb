"""A root whose every checkpoint was quarantined never starts from scratch in silence.

A load that finds a checkpoint damaged moves it into ``<root>/.quarantine/`` (``prune.quarantine``)
and falls back to an older one. When none is left -- the root holds no committed checkpoint of
its layout, and quarantined ones -- there is nothing to resume from, and "no checkpoint" (None)
would let a scheduler's retry train from step 0 as if the run had never saved. ``load_latest``
raises ``AllCheckpointsQuarantined`` instead, naming what is quarantined and why, at every try.

``start_fresh(root)`` is the way to start from scratch on purpose: it records in each quarantined
checkpoint's note that the run was started fresh past it, and moves or deletes nothing.
``load_latest`` then returns None, saying so in the log (WARNING), until a new step commits; a
checkpoint quarantined after that is new damage and raises again. A root that never held a
checkpoint (no quarantine either) still returns None quietly.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncckpt.core import layout as L
from asyncckpt.errors import AllCheckpointsQuarantined
from asyncckpt.storage import localfs
from asyncckpt.storage.prune import Quarantined, list_quarantined

__all__ = ["FRESH_START_AT", "start_fresh", "check_not_lost"]

log = logging.getLogger("asyncckpt")

#: The key ``start_fresh`` adds to a quarantined checkpoint's note: when (unix time).
FRESH_START_AT = "fresh_start_at"
#: How many quarantined checkpoints the error names (the newest first); the rest are counted.
NAMED = 5


def _note_path(quarantined: Path) -> Path:
    return quarantined.parent / f"{quarantined.name}{L.QUARANTINE_INFO_SUFFIX}"


def _read_note(quarantined: Path) -> dict[str, Any] | None:
    try:
        note = json.loads(_note_path(quarantined).read_text())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def _settled(q: Quarantined) -> bool:
    """Whether ``start_fresh`` was called past ``q``."""
    return FRESH_START_AT in (_read_note(q.path) or {})


def start_fresh(root: str | os.PathLike) -> list[Path]:
    """Start from scratch on purpose in ``root``, whose checkpoints were all quarantined.

    Each checkpoint in ``root/.quarantine/`` gets a note that the run was started fresh past
    it (the time); nothing is moved or deleted (``python -m asyncckpt ls`` still lists them).
    ``load_latest`` then returns None instead of raising ``AllCheckpointsQuarantined``, until a
    new step commits; one quarantined later raises again. Returns the quarantined directories
    it settled ([] when there are none). Call it while no engine runs on ``root``."""
    qdir = Path(root) / L.QUARANTINE_DIR
    try:
        entries = sorted(
            (e for e in os.scandir(qdir) if e.is_dir(follow_symlinks=False)), key=lambda e: e.name
        )
    except (FileNotFoundError, NotADirectoryError):
        return []
    now = time.time()
    out = []
    for e in entries:
        path = Path(e.path)
        note = _read_note(path) or {"name": e.name}  # (a note lost: a new one, step unknown)
        if FRESH_START_AT not in note:
            note[FRESH_START_AT] = now
            localfs.replace_synced(_note_path(path), json.dumps(note, indent=1).encode())
        out.append(path)
    log.warning(
        "start_fresh(%s): %d quarantined checkpoint(s) settled; the next load_latest starts "
        "from scratch",
        root,
        len(out),
    )
    return out


def check_not_lost(root: Path, layout: str, tried: Sequence[str] = ()) -> None:
    """Raise ``AllCheckpointsQuarantined`` when ``root`` holds no committed checkpoint of
    ``layout`` but quarantined ones that ``start_fresh`` did not settle. ``tried``: what this
    load found wrong (step by step), said first. With nothing tried and every quarantined one
    settled, says in the log that the run starts from scratch on purpose."""
    if L.scan(root, layout):
        return
    every = list_quarantined(root, layout)
    lost = [q for q in every if not _settled(q)]
    if lost:
        raise AllCheckpointsQuarantined(_message(root, lost, tried), lost)
    if every and not tried:
        log.warning(
            "%s holds no checkpoint: the %d in %s are quarantined (damaged) and start_fresh was "
            "called past them; starting from scratch",
            root,
            len(every),
            root / L.QUARANTINE_DIR,
        )


def _message(root: Path, lost: list[Quarantined], tried: Sequence[str]) -> str:
    newest = sorted(lost, key=lambda q: (q.step is not None, q.step or 0), reverse=True)
    named = []
    for q in newest[:NAMED]:
        what = f"step {q.step}" if q.step is not None else q.name
        why = q.problems[0] if q.problems else "no note says why"
        more = f" (and {len(q.problems) - 1} more)" if len(q.problems) > 1 else ""
        # (what this load found is said first: only where each went, then)
        named.append(f"{what} at {q.path}" + ("" if tried else f": {why}{more}"))
    if len(newest) > NAMED:
        named.append(f"{len(newest) - NAMED} more in {root / L.QUARANTINE_DIR}")
    first = f"{'; '.join(tried)}. " if tried else ""
    back = f" ({root / newest[0].name})" if newest[0].step is not None else ""
    return (
        f"no checkpoint is left in {root}: every one was found damaged and quarantined, so "
        f"nothing was loaded (starting from step 0 would drop the run in silence). {first}"
        f"Quarantined: {'; '.join(named)}. To resume, repair one (or restore it from a copy "
        f"elsewhere) and move it back to its old name{back}; to start from scratch on "
        f"purpose, run `python -m asyncckpt start-fresh {root}` or call "
        f"asyncckpt.start_fresh({str(root)!r}) (what is quarantined stays where it is) and "
        "load again."
    )
