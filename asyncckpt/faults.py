"""Named fault points: a public testing aid for crash-recovery tests.

The pipeline calls ``point(name)`` at each boundary. Normally that is a dictionary lookup and
nothing else. A test arms a point from code::

    from asyncckpt import faults
    faults.inject("before_rename", "kill")            # SIGKILL the process that reaches it
    faults.inject("mid_shard_write", "enospc", after=2)  # the 3rd time it is reached

or from the environment of a training script it runs as a subprocess::

    ASYNCCKPT_FAULTS="before_rename=kill;mid_prune=delay:0.5" python train.py

Actions: ``kill`` (SIGKILL), ``hang`` (sleep forever), ``enospc`` / ``eio`` (raise ``OSError``),
``delay:SECONDS``, ``raise`` (``RuntimeError``). ``after=k`` skips the first k hits. Points set in
the training process travel to the worker process with every job, so a test can arm a point
that only the worker reaches.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from dataclasses import dataclass

ENV_VAR = "ASYNCCKPT_FAULTS"

#: Every boundary the pipeline announces, in pipeline order.
POINTS = (
    "after_stage",  # trainer: state copied into the staging arena, job not yet sent
    "before_shard_write",  # worker: temp dir created, no shard written yet
    "mid_shard_write",  # worker: inside a shard file, some bytes written
    "after_shard_write",  # worker: shards written, not yet fsynced
    "before_metadata",  # worker: shards durable, manifest not yet written
    "before_rename",  # worker: everything durable in the temp dir, not committed
    "before_tracker",  # worker: renamed (committed), tracker not yet updated
    "after_commit",  # worker: tracker updated, before pruning
    "mid_prune",  # worker: a checkpoint renamed to trash, not yet removed
)
ACTIONS = ("kill", "hang", "enospc", "eio", "delay", "raise")


@dataclass
class Fault:
    action: str
    after: int = 0
    seconds: float = 0.0
    hits: int = 0


_lock = threading.Lock()
_faults: dict[str, Fault] = {}


def _check(point: str, action: str) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    if action not in ACTIONS:
        raise ValueError(f"unknown fault action {action!r}; known: {', '.join(ACTIONS)}")


def inject(point: str, action: str, *, after: int = 0, seconds: float = 0.0) -> None:
    """Arm ``point`` so that its ``after+1``-th hit performs ``action``."""
    if ":" in action:  # "delay:0.5"
        action, arg = action.split(":", 1)
        seconds = float(arg)
    _check(point, action)
    if after < 0:
        raise ValueError("after must be >= 0")
    with _lock:
        _faults[point] = Fault(action, after, seconds)


def clear(point: str | None = None) -> None:
    """Disarm one point, or all of them."""
    with _lock:
        if point is None:
            _faults.clear()
        else:
            _faults.pop(point, None)


def parse_spec(spec: str) -> dict[str, Fault]:
    """Parse ``"before_rename=kill;mid_shard_write=eio@2;after_stage=delay:0.3"``.

    ``@k`` is ``after=k``. Entries are separated by ``;`` or ``,``.
    """
    out: dict[str, Fault] = {}
    for entry in spec.replace(",", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        if "=" not in entry:
            raise ValueError(f"{ENV_VAR}: expected point=action, got {entry!r}")
        point, action = (s.strip() for s in entry.split("=", 1))
        after = 0
        if "@" in action:
            action, k = action.split("@", 1)
            after = int(k)
        seconds = 0.0
        if ":" in action:
            action, arg = action.split(":", 1)
            seconds = float(arg)
        _check(point, action)
        out[point] = Fault(action, after, seconds)
    return out


def load_env() -> None:
    """Arm the points named in ``$ASYNCCKPT_FAULTS`` (called on import and in the worker)."""
    spec = os.environ.get(ENV_VAR, "")
    if spec:
        parsed = parse_spec(spec)
        with _lock:
            _faults.update(parsed)


def snapshot() -> dict[str, tuple[str, int, float]]:
    """The armed points, picklable, to ship to the worker with a job."""
    with _lock:
        return {p: (f.action, max(f.after - f.hits, 0), f.seconds) for p, f in _faults.items()}


def install(snap: dict[str, tuple[str, int, float]]) -> None:
    """Replace the armed points with a snapshot taken in another process."""
    with _lock:
        _faults.clear()
        for p, (action, after, seconds) in snap.items():
            _faults[p] = Fault(action, after, seconds)


def point(name: str) -> None:
    """Announce that the pipeline reached ``name``; perform the armed action, if any."""
    if not _faults:  # the common case: one dict truth test
        return
    with _lock:
        fault = _faults.get(name)
        if fault is None:
            return
        fault.hits += 1
        if fault.hits <= fault.after:
            return
        if fault.action != "delay":
            del _faults[name]  # fire once; a delay stays armed
    _perform(name, fault)


def _perform(name: str, fault: Fault) -> None:
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # not reached
    elif fault.action == "hang":
        while True:
            time.sleep(3600)
    elif fault.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
    elif fault.action == "eio":
        raise OSError(errno.EIO, f"Input/output error (injected at {name})")
    elif fault.action == "delay":
        time.sleep(fault.seconds)
    elif fault.action == "raise":
        raise RuntimeError(f"fault injected at {name}")


load_env()
