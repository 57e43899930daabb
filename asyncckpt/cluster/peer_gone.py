"""A rank's worker that died with its trainer, told to the workers of that run that wait for it.

When every trainer of a multi-rank run dies, each surviving worker persists what its trainer
staged, and every rank's part of a step is committed together: the workers form a group per
save (``dist.job_group``). A worker that died as well never comes, and the others waited for
it the group's whole timeout (``Distributed(timeout=)``, 600 s by default) before failing the
step; their new trainers waited as long for them (a hot resume waits for a surviving worker
to offer or end, ``hot._connect``).

The new trainer of that rank knows at once: its old worker's lock is free. So:

* rank 0's engine records its run's side store under the root (``record_run``:
  ``.asyncckpt-runs/<token>``), removed when the engine closes;
* each worker notes which run it serves (``note_worker``: ``.asyncckpt-runs/worker<rank>``);
* a new engine whose rank's last worker is gone (its lock free) says so to that worker's run
  before it joins its own (``announce_if_gone``: the key ``asyncckpt/<token>/gone`` in that
  run's side store, served by its rank 0's worker while it lives); a record whose store no
  longer answers is removed;
* every worker meets its peers before a save's group (``meet``): it counts itself in and
  waits for the others, and fails the save at once when a rank of its run is said to be
  gone. The meeting also decides whether the group kept from the last save serves again
  (``dist.job_group``).

One root that every rank shares (a node-local root shows the record to its own node only).
A rank whose new trainer never starts (its node is lost) still costs the timeout. A run's
record stays while a worker's note names it (a crashed run's rank 0 never removed its own),
and goes when rank 0 of a later run records its own.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from pathlib import Path
from typing import Any

from asyncckpt.cluster import dist as _dist
from asyncckpt.storage import localfs
from asyncckpt.storage.localfs import lock_held, lock_path

log = logging.getLogger("asyncckpt")

RUNS_DIR = ".asyncckpt-runs"
#: Seconds a new engine tries to reach an old run's side store (it is on this job's hosts,
#: or gone: a dead host must not hold the resume).
ANNOUNCE_TIMEOUT_S = 5.0
#: Seconds between looks at the count of workers met and at the "gone" key.
POLL_S = 0.2


class PeerWorkerGone(RuntimeError):
    """A rank's worker of this run died with its trainer: no save of the run can commit."""


def gone_key(token: str) -> str:
    return f"asyncckpt/{token}/gone"


def record_run(root: Path, host: str, port: int, token: str) -> Path:
    """Rank 0's engine: its run's side store, for the engines of a later run (atomic). The
    records of runs no worker's note names go: only a note leads to a record
    (``announce_if_gone``), and a run that crashed left its record behind."""
    path = _runs(root) / token
    localfs.replace_synced(path, f"{host}:{port}\n".encode())
    named = {token}
    with contextlib.suppress(OSError):
        for note in (Path(root) / RUNS_DIR).glob("worker*"):
            with contextlib.suppress(OSError):
                named.add(note.read_text().strip())
    for old in set(recorded_runs(root)) - named:
        forget_run(root, old)
    return path


def _runs(root: str | Path) -> Path:
    """The directory of the records, made if missing."""
    runs = Path(root) / RUNS_DIR
    localfs.mkdir(runs, exist_ok=True)
    return runs


def forget_run(root: Path, token: str) -> None:
    with contextlib.suppress(OSError):
        localfs.remove_tree(Path(root) / RUNS_DIR / token)


def recorded_runs(root: Path) -> dict[str, tuple[str, int]]:
    """token -> (host, port) of every run recorded under ``root``."""
    out: dict[str, tuple[str, int]] = {}
    with contextlib.suppress(OSError):
        for path in (Path(root) / RUNS_DIR).iterdir():
            if path.name.startswith(localfs.TMP_PREFIX):
                continue
            with contextlib.suppress(OSError, ValueError):
                host, port = path.read_text().strip().rsplit(":", 1)
                out[path.name] = (host, int(port))
    return out


def note_worker(root: str | Path, rank: int, token: str) -> None:
    """A worker of several ranks: which run it serves, for its rank's next engine."""
    localfs.replace_synced(_runs(root) / f"worker{rank}", f"{token}\n".encode())


def announce_if_gone(root: Path, rank: int) -> str | None:
    """A new engine of ``rank``, before it joins its own run: if the last worker of this rank
    on ``root`` is gone (its lock free), tell that worker's run, which may wait for it; returns
    that run's token once told. Its record goes either way (told, or its store is gone)."""

    note = Path(root) / RUNS_DIR / f"worker{rank}"
    try:
        token = note.read_text().strip()
    except OSError:
        return None  # no worker of several ranks ran here for this rank
    if not token or lock_held(lock_path(root, f"worker{rank}")):
        return None  # alive: it comes to its saves itself
    told = None
    where = recorded_runs(root).get(token)
    if where is not None:
        told = token if _tell(token, where, rank) else None
        if told is None:
            forget_run(root, token)  # its store does not answer: that run is over
    with contextlib.suppress(OSError):
        localfs.remove_tree(note)
    return told


def _tell(token: str, where: tuple[str, int], rank: int) -> bool:
    import torch.distributed as dist

    host, port = where
    try:
        td = datetime.timedelta(seconds=ANNOUNCE_TIMEOUT_S)
        dist.TCPStore(host, port, None, False, td).set(gone_key(token), str(rank))
    except Exception as e:  # noqa: BLE001 - that run is over
        log.debug("run %s's side store at %s:%d does not answer (%s)", token, host, port, e)
        return False
    log.warning(
        "rank %d: its worker of run %s is gone: told that run's other workers, which fail the "
        "steps they wait to commit with it instead of waiting out their timeout",
        rank,
        token,
    )
    return True


def meet(
    store: Any,
    token: str,
    tag: str,
    world_size: int,
    timeout: float,
    fresh: bool,
    *,
    rank: int = -1,
    again: bool = False,
) -> bool:
    """Count this worker in for the group ``tag`` and wait until every rank's is, or fail
    with ``PeerWorkerGone`` as soon as a rank of the run is said to be gone. Returns whether
    the group must be formed afresh: ``fresh`` is this worker's say (it holds no sound group
    from the last save), and one rank's say is every rank's answer.

    Every worker of the run meets before every save's group (a stand-in, one whose trainer
    lives and one whose trainer died may form one group together). Waiting is a look at two
    keys, soon after arriving and then less often (``POLL_S`` at most): ranks that save
    together arrive close together, so a save waits about as long as before, and the store
    serves O(1) requests per rank and look (not a wait with a time limit: a timed-out wait on
    a TCPStore connection can leave its answer to arrive as the answer to the next request).
    A worker that asks for a fresh group says so before it counts itself in, so every rank
    reads the same answer once the count is whole.

    Rank 0 also says which save it meets for. ``again``: this meeting started on a store that
    has since been replaced with rank 0's worker; it fails once rank 0's new worker meets
    for a later save (it will never come to this one: the save died with the old worker).
    """
    count = f"asyncckpt/{token}/{tag}/met"
    afresh = f"asyncckpt/{token}/{tag}/fresh"
    at = _rank0_at(token)
    gone = gone_key(token)
    deadline = time.monotonic() + timeout
    pause = 0.002
    if rank == 0:
        store.set(at, tag)
    if fresh:
        store.set(afresh, "1")
    n = store.add(count, 1)
    while n < world_size:
        if store.check([gone]):
            raise PeerWorkerGone(
                f"rank {store.get(gone).decode()}'s worker is gone (its new trainer said so): "
                "no save of this run can commit"
            )
        if again and store.check([at]) and _later(store.get(at).decode(), tag):
            raise PeerWorkerGone(
                f"rank 0's worker was replaced during save {tag} and its new one went on to "
                f"save {store.get(at).decode()}: save {tag} cannot commit"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{world_size - n} rank(s) never came to the save in {timeout}s")
        time.sleep(pause)
        pause = min(pause * 2, POLL_S)
        n = store.add(count, 0)
    return fresh or store.check([afresh])


def _rank0_at(token: str) -> str:
    return f"asyncckpt/{token}/rank0-meets"


def _later(tag: str, than: str) -> bool:
    """Whether save ``tag`` ("step.attempt", or "step.attempt.memory": worker.job_tag) comes
    after ``than``: steps increase, and a step's attempts too; a memory checkpoint persisted
    at the trainer's death comes after the disk save of its step and attempt."""

    def order(t: str) -> tuple[int, int, bool]:
        step, attempt, *tier = t.split(".")
        return int(step), int(attempt), bool(tier)

    try:
        return order(tag) > order(than)
    except ValueError:
        return False


def meet_on_side_store(cfg: Any, tag: str, fresh: bool) -> bool:
    """``meet`` over this worker's connection to the run's side store (``dist.job_store``),
    and once more over a new connection if that one drops during the meeting *and* the new
    one reaches another store: rank 0's worker, which serves the store, was replaced (it
    serves a fresh one on the same socket), and every count and flag went with the old store,
    so the meeting starts again there. The same store still serving (a connection lost, not
    the store) fails the save: this worker's count may already be in it."""
    import torch.distributed as dist

    store = _dist.job_store(cfg)
    was = _dist.job_store_id(cfg)
    args = (cfg.token, tag, cfg.world_size, cfg.timeout, fresh)
    try:
        return meet(store, *args, rank=cfg.rank)
    except dist.DistNetworkError as e:
        if cfg.recovery_store is not None or was is None:  # (a file; a store with no name)
            raise
        _dist.forget_job_store(cfg)
        store = _dist.job_store(cfg, named=True)  # (``was`` says ``serve`` names it)
        now = _dist.job_store_id(cfg)
        if now is None or now == was:
            raise
        log.info(
            "rank %d: the side store was replaced during save %s's meeting (%s)", cfg.rank, tag, e
        )
        return meet(store, *args, rank=cfg.rank, again=True)
