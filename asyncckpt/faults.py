"""Named fault points: a public testing aid for crash-recovery tests.

The pipeline calls ``point(name)`` at each boundary. Normally that is a dictionary lookup and
nothing else. A test arms a point from code::

    from asyncckpt import faults
    faults.inject("before_rename", "kill")            # SIGKILL the process that reaches it
    faults.inject("mid_shard_write", "enospc", after=2)  # the 3rd time it is reached

or from the environment of a training script it runs as a subprocess::

    ASYNCCKPT_FAULTS="before_rename=kill;mid_prune=delay:0.5" python train.py

Actions: ``kill`` (SIGKILL), ``hang`` (sleep forever), ``enospc`` / ``eio`` (raise ``OSError``),
``delay:SECONDS``, ``raise`` (``RuntimeError``), ``corrupt`` (flip a bit of the bytes the point
holds: only at ``CORRUPT_POINTS``, e.g. the arena a surviving worker offers a new engine). ``after=k`` skips the first k hits. Points set in
the training process travel to the worker process with every job, so a test can arm a point
that only the worker reaches. Every action but ``delay`` fires once: when a point fires in the
worker, the worker tells the trainer, which disarms it, so a restarted worker does not fire it
again. The training process is the source of truth: ``clear()`` there disarms the worker too
(from its next job on).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

ENV_VAR = "ASYNCCKPT_FAULTS"

#: Every boundary the pipeline announces, in pipeline order.
POINTS = (
    "mid_stage",  # trainer: part of the state copied into the staging arena, not all
    "after_stage",  # trainer: state copied into the staging arena, job not yet sent
    "before_shard_write",  # worker: temp dir created, no shard written yet
    "mid_shard_write",  # worker: inside a shard file, some bytes written
    "after_shard_write",  # worker: shards written, not yet fsynced
    "before_metadata",  # worker: shards durable, manifest not yet written
    "before_rename",  # worker: everything durable in the temp dir, not committed
    "before_tracker",  # worker: renamed (committed), tracker not yet updated
    "after_commit",  # worker: tracker updated, before pruning
    "mid_prune",  # worker: a checkpoint renamed to trash, not yet removed
    # With a remote tier (storage/): after the local commit, before the save's handle resolves.
    "mid_upload",  # worker: a file of the checkpoint uploaded, the rest not yet
    "before_marker",  # worker: every file uploaded, the commit marker not yet written
    "before_remote_tracker",  # worker: the marker written, the store's tracker not yet
    "mid_remote_prune",  # worker: a remote checkpoint's marker deleted, its files not yet
    # With an HFExport (export.py): after the commit, before the save's handle resolves.
    "mid_export",  # worker: a file of a Hugging Face export written, the export not published
    # With MemoryTier(replicas=1) (replication.py): a memory save's replica being sent.
    "mid_replication",  # worker: the replica's header sent, none of its bytes yet
    # With MemoryTier(hold_seconds=) (hot_serve.py): the trainer is gone, what its worker
    # wrote is committed, and the worker is about to offer those bytes to a new engine.
    "before_hot_serve",  # worker: the arena of the step offered, before the offer
    # Several ranks (dist.py): before a save's group of every rank's worker is formed.
    "before_job_group",  # worker: nothing of the save written yet
    # A state over Staging(max_host_bytes=), staged in chunks (chunked.py):
    "between_chunks",  # trainer: a chunk copied and handed over, the next not yet copied
    "mid_chunk_write",  # worker: a chunk written, the next not yet (its buffer given back)
)
#: The points only a save with a remote tier reaches (storage/); the others, every save.
REMOTE_POINTS = ("mid_upload", "before_marker", "before_remote_tracker", "mid_remote_prune")
#: The points only a save with a due HFExport reaches.
EXPORT_POINTS = ("mid_export",)
#: A point for tests of torn states (a delay while staging); crash tests cover the trainer's
#: staging through ``after_stage``.
STAGE_POINTS = ("mid_stage",)
#: The point only a replicated memory save reaches (fired from the job's own snapshot: the
#: sender runs beside the main loop, which installs the snapshots of the saves it writes).
REPLICA_POINTS = ("mid_replication",)
#: The point only a worker that outlived its trainer with hold_seconds reaches (hot_serve.py).
HOT_POINTS = ("before_hot_serve",)
#: The points only a save staged in chunks reaches (a state over its staging budget).
CHUNK_POINTS = ("between_chunks", "mid_chunk_write")
#: The point only a save of several ranks reaches.
RANKS_POINTS = ("before_job_group",)
LOCAL_POINTS = tuple(
    p
    for p in POINTS
    if p
    not in REMOTE_POINTS
    + EXPORT_POINTS
    + STAGE_POINTS
    + REPLICA_POINTS
    + HOT_POINTS
    + CHUNK_POINTS
    + RANKS_POINTS
)
ACTIONS = ("kill", "hang", "enospc", "eio", "delay", "raise", "corrupt")
#: The points that hand ``point`` bytes a ``corrupt`` action may flip (one bit of the first).
CORRUPT_POINTS = HOT_POINTS


@dataclass
class Fault:
    action: str
    after: int = 0
    seconds: float = 0.0
    hits: int = 0
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


_lock = threading.Lock()
#: ``armed_for``'s fault ids, per thread (none: every armed fault).
_scope = threading.local()
_faults: dict[str, Fault] = {}
#: Ids of faults that fired in this process; a snapshot never re-arms them.
_fired: set[str] = set()
#: Called with a fault's id just before it fires (the worker tells the trainer).
_reporter: Callable[[str], None] | None = None


def _check(point: str, action: str) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    if action not in ACTIONS:
        raise ValueError(f"unknown fault action {action!r}; known: {', '.join(ACTIONS)}")
    if action == "corrupt" and point not in CORRUPT_POINTS:
        raise ValueError(
            f"'corrupt' needs a point that holds bytes ({', '.join(CORRUPT_POINTS)}), not {point!r}"
        )


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


def snapshot() -> dict[str, tuple[str, int, float, str]]:
    """The armed points, picklable, to ship to the worker with a job."""
    with _lock:
        return {
            p: (f.action, max(f.after - f.hits, 0), f.seconds, f.id) for p, f in _faults.items()
        }


def install(snap: dict[str, tuple[str, int, float, str]]) -> None:
    """Adopt the armed points of a snapshot taken in the training process.

    A point the snapshot no longer arms (or arms anew) is dropped; one already armed here keeps
    its own hit count; one that already fired here is not armed again.
    """
    with _lock:
        for p in list(_faults):
            entry = snap.get(p)
            if entry is None or entry[3] != _faults[p].id:
                del _faults[p]
        for p, (action, after, seconds, fid) in snap.items():
            if p not in _faults and fid not in _fired:
                _faults[p] = Fault(action, after, seconds, id=fid)


def consume(fault_id: str) -> None:
    """Disarm the fault ``fault_id`` here: it fired in another process (the worker)."""
    with _lock:
        for p, f in list(_faults.items()):
            if f.id == fault_id and f.action != "delay":
                del _faults[p]


def set_reporter(report: Callable[[str], None] | None) -> None:
    """Call ``report(fault_id)`` whenever a fault fires in this process (the worker sets it)."""
    global _reporter
    _reporter = report


@contextlib.contextmanager
def armed_for(snap: dict[str, tuple[str, int, float, str]]) -> Iterator[None]:
    """Within it, this thread's points fire only the faults armed in ``snap`` (a job's
    snapshot). For a thread that works for one save beside the main loop (an upload): the main
    loop installs the points of the next save when it starts writing it, and a point armed
    after this save was made is not this save's."""
    before = getattr(_scope, "ids", None)
    _scope.ids = frozenset(entry[3] for entry in snap.values())
    try:
        yield
    finally:
        _scope.ids = before


def point(name: str, data: memoryview | None = None) -> None:
    """Announce that the pipeline reached ``name``; perform the armed action, if any
    (``data``: the bytes a ``corrupt`` action flips a bit of)."""
    if not _faults:  # the common case: one dict truth test
        return
    with _lock:
        fault = _faults.get(name)
        if fault is None:
            return
        scope = getattr(_scope, "ids", None)
        if scope is not None and fault.id not in scope:
            return  # armed for a later save than the one this thread works for (not a hit)
        fault.hits += 1
        if fault.hits <= fault.after:
            return
        if fault.action != "delay":
            del _faults[name]  # fire once; a delay stays armed
            _fired.add(fault.id)
        report = _reporter if fault.action != "delay" else None
    if report is not None:
        try:
            report(fault.id)
        except Exception:  # noqa: BLE001 - a closed pipe must not stop the fault itself
            pass
    _perform(name, fault, data)


def point_of(snap: dict[str, tuple[str, int, float, str]], name: str) -> None:
    """``point(name)`` as armed in a job's snapshot (every hit fires), for a thread that must
    not install it over the main loop's."""
    entry = snap.get(name)
    if entry is not None and entry[3] not in _fired:
        action, _, seconds, fid = entry
        if action != "delay":
            with _lock:
                _fired.add(fid)
        _perform(name, Fault(action, 0, seconds, id=fid))


def _perform(name: str, fault: Fault, data: memoryview | None = None) -> None:
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
    elif fault.action == "corrupt" and data is not None and len(data):
        data[len(data) // 2] ^= 0x01  # one bit, mid-way: the checksum must notice


load_env()
