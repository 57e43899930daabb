"""The goodput ledger: where a run's wall time went, per run and across restarts, in one small
JSON file in the root (``.asyncckpt-goodput.json``).

The categories are those of Google's ML Goodput measurement: time ``save()`` held the training
loop (save blocking), loading (restore), the engine's start (waiting for the old worker
included), wasted progress (the steps a resumed run repeats, times the measured step time)
and productive time (the rest of the wall time). ``RunRecord`` is one engine's run;
``Ledger`` is the file (``read_ledger`` / ``write_ledger``); ``summarize`` adds the runs up.
Everything here is arithmetic over plain numbers, except the two file functions.

Only rank 0's engine writes the file: goodput is the job's figure (the ranks step together,
the slowest rank sets the pace), one file keeps a shared root's listing small, and no two
processes race to replace it. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from asyncckpt.storage.localfs import write_note

#: The ledger's file name, in the root.
LEDGER_NAME = ".asyncckpt-goodput.json"
#: Runs kept in the file (the oldest dropped first): a year of daily restarts.
MAX_RUNS = 400
VERSION = 1


@dataclass
class RunRecord:
    """One engine's run, as the ledger keeps it (seconds unless named otherwise)."""

    run_id: str
    #: unix time the engine was built, and of this record's last write
    started_at: float
    updated_at: float
    #: building the engine and ``start()`` (waiting for the previous run's worker included)
    startup_seconds: float = 0.0
    #: ``load`` / ``load_latest`` calls
    load_seconds: float = 0.0
    #: time ``save()`` held the training loop, every tier
    save_blocking_seconds: float = 0.0
    saves: int = 0
    #: the step this run resumed from (None: it loaded nothing)
    resumed_step: int | None = None
    #: steps the previous run had reached beyond ``resumed_step``: this run repeats them
    wasted_steps: int = 0
    #: the highest step this run reached (the steps ``save``, ``should_save`` and ``due`` saw)
    highest_step: int | None = None
    #: seconds per training step, saves and loads left out (None: not measured yet)
    step_seconds: float | None = None
    #: True once the engine was closed (False: the run died, or still runs)
    closed: bool = False

    @property
    def wall_seconds(self) -> float:
        return max(0.0, self.updated_at - self.started_at)

    @property
    def wasted_seconds(self) -> float:
        return self.wasted_steps * (self.step_seconds or 0.0)

    @property
    def productive_seconds(self) -> float:
        """The rest of the wall time: training steps that count."""
        bad = self.startup_seconds + self.load_seconds + self.save_blocking_seconds
        return max(0.0, self.wall_seconds - bad - self.wasted_seconds)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            wall_seconds=self.wall_seconds,
            wasted_seconds=self.wasted_seconds,
            productive_seconds=self.productive_seconds,
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def wasted_steps(previous_highest: int | None, resumed_step: int) -> int:
    """Steps a run resumed at ``resumed_step`` repeats of a previous run that reached
    ``previous_highest`` (0 when it resumed at or past it)."""
    if previous_highest is None:
        return 0
    return max(0, previous_highest - resumed_step)


@dataclass(frozen=True)
class Goodput:
    """The ledger's runs added up: seconds per category, and their share of the wall time.

    ``goodput`` = productive / wall (None before any wall time); ``down_seconds``: time
    between one run's last record and the next run's start (the job was not running, or the
    previous run died after its last record): reported, not part of the wall time."""

    runs: int = 0
    wall_seconds: float = 0.0
    productive_seconds: float = 0.0
    save_blocking_seconds: float = 0.0
    load_seconds: float = 0.0
    startup_seconds: float = 0.0
    wasted_seconds: float = 0.0
    wasted_steps: int = 0
    down_seconds: float = 0.0
    goodput: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(runs: list[RunRecord]) -> Goodput:
    """Add ``runs`` (oldest first) up by category."""
    down = sum(max(0.0, b.started_at - a.updated_at) for a, b in zip(runs, runs[1:], strict=False))
    wall = sum(r.wall_seconds for r in runs)
    productive = sum(r.productive_seconds for r in runs)
    return Goodput(
        runs=len(runs),
        wall_seconds=wall,
        productive_seconds=productive,
        save_blocking_seconds=sum(r.save_blocking_seconds for r in runs),
        load_seconds=sum(r.load_seconds for r in runs),
        startup_seconds=sum(r.startup_seconds for r in runs),
        wasted_seconds=sum(r.wasted_seconds for r in runs),
        wasted_steps=sum(r.wasted_steps for r in runs),
        down_seconds=down,
        goodput=productive / wall if wall > 0 else None,
    )


def restart_seconds(runs: list[RunRecord]) -> float | None:
    """The mean cost of getting back to training of the runs that resumed (start-up + load):
    what a failure costs besides the work it loses; None when no run resumed yet."""
    resumed = [r.startup_seconds + r.load_seconds for r in runs if r.resumed_step is not None]
    return sum(resumed) / len(resumed) if resumed else None


@dataclass
class Ledger:
    """The file: its runs, oldest first."""

    runs: list[RunRecord] = field(default_factory=list)

    def put(self, record: RunRecord) -> None:
        """Add ``record`` or replace the run of its id."""
        for i, r in enumerate(self.runs):
            if r.run_id == record.run_id:
                self.runs[i] = record
                return
        self.runs.append(record)
        del self.runs[:-MAX_RUNS]

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "total": summarize(self.runs).as_dict(),
            "runs": [r.as_dict() for r in self.runs],
        }


def ledger_path(root: str | os.PathLike) -> Path:
    return Path(root) / LEDGER_NAME


def read_ledger(root: str | os.PathLike) -> Ledger | None:
    """The root's ledger; None when there is none (or it is not one: a damaged ledger
    starts over, it holds no checkpoint)."""
    try:
        d = json.loads(ledger_path(root).read_text())
        return Ledger([RunRecord.from_dict(r) for r in d["runs"]])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_ledger(root: str | os.PathLike, ledger: Ledger) -> None:
    """Replace the root's ledger atomically (a temporary renamed over it; no fsync: a crash
    loses at most the last few seconds of figures, never a checkpoint)."""
    write_note(ledger_path(root), json.dumps(ledger.as_dict(), indent=1).encode())
