"""The worker's side of a hot resume (``MemoryTier(hold_seconds=)``; hot_resume.py: the trainer's).

When its trainer dies, a worker finishes what it was writing (staged saves, the memory
checkpoint it held: worker/loop.py, memory/hold.py). The step it persists after the death (the
memory checkpoint) is offered *before a byte of it is written* (``offer_staged``): with each
tensor's dtype, shape and CRC-32C, computed here from the staged memory, and the objects and
paths a load needs, so a new engine reads no file (hot_load.py) and waits for no write. It
takes such a step only if it is newer than every committed one (the step ``load_latest`` picks
once the commit is done) and checks every tensor against those checksums. Here, once the files
are written, the memory is checksummed again (``EarlyOffer.unchanged``): if it changed since
the offer the save fails (the files hold what the memory held when written); else the commit
records the offered checksums in the manifest (``offered``). The new engine's ``start()``
(which waits for this worker's lock, held until the commit ends) checks that the step
committed recording the very same checksums, and reads the disk instead when it did not
(hot_resume.py ``HotResume.settle``). A failed commit withdraws the offer here.

By default (``MemoryTier()``: no ``hold_seconds``) a worker holds for ``DEFAULT_HOLD_S``, and
only when it persisted a memory save after the death (the step the disk did not have) and the
node has room for a new trainer's staging beside the memory it keeps (``HotServe.hold_seconds``;
else it says why and exits once written, as with ``hold_seconds=0``).

Several ranks: every rank's worker offers its own part so, and the new ranks agree over the
old run's side store (``Offer.vote``) to take the step from memory on every rank or on none.
Otherwise (a staged disk save, written before the worker learnt of the death) the newest step
it wrote is offered once committed, as before. Either way the offer is served
for ``hold_seconds`` over a local socket named after the root and the rank (an abstract Unix
socket: this node only, this user only); the worker lock is released once the commit is over.

What travels: the step, the files this rank wrote for it, where each tensor's bytes lie in the
arenas, and the arenas' shared-memory file descriptors (``SCM_RIGHTS``): a fixed header and
JSON (hot_offer.py), never a pickle. Each side checks that the other runs as this user
(``SO_PEERCRED``) before anything else. The new engine decodes the offer field by field, maps
the arenas and checks every byte it copies against the manifest (or the offered checksums);
nothing offered here is trusted beyond being a place to copy from. The offer goes once: the
memory is freed when the new engine unmaps it (or when this process exits, at
``hold_seconds``, if nobody came).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from asyncckpt import faults
from asyncckpt.core.savejob import SaveJob, TensorSpec
from asyncckpt.memory.hot_offer import HEADER, MAGIC, Offer, encode_offer
from asyncckpt.memory.service import WorkerService, WorkerView, Written
from asyncckpt.staging.arenas import check_memory
from asyncckpt.storage.manifest import checksum

log = logging.getLogger("asyncckpt")

#: SO_PEERCRED's ``struct ucred``: pid, uid, gid.
UCRED = struct.Struct("3i")
#: How long one client may take to read the offer before the next one is served.
CLIENT_TIMEOUT_S = 10.0
#: How long a client that took an offer may take to say it is done reading (DONE).
LOAD_TIMEOUT_S = 600.0
#: The client's last byte: mapped (``TAKEN``), then done reading (``DONE``).
TAKEN, DONE = b"T", b"D"
#: ``MemoryTier()``'s hold (no ``hold_seconds`` given): a restarted trainer (torchrun, a
#: job's retry) reaches its ``load_latest`` within this on one node; held only with room.
DEFAULT_HOLD_S = 30.0


def hold_for(hold_seconds: float | None) -> float:
    """The worker's ``hot_hold_s`` for ``MemoryTier(hold_seconds=)`` (None: the default)."""
    return DEFAULT_HOLD_S if hold_seconds is None else float(hold_seconds)


def socket_name(root: str | os.PathLike, rank: int) -> str:
    """The abstract socket a surviving worker of ``rank`` on ``root`` listens on."""
    key = hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:20]
    return f"\0asyncckpt-hot-{key}-{rank}"


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of ``conn``."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    return UCRED.unpack(raw)[1]


class HotServe(WorkerService):
    """A hot resume's worker side, as a worker's service: the step persisted after the
    trainer's death offered before it is written (``before_write``), checked again once
    written (``after_write``), its checksums recorded by the commit (``manifest``; several
    ranks: ``checksums``) or the offer withdrawn (``failed``); once the loop ended, the offer
    served for ``hold_seconds`` (``close``)."""

    def __init__(self, worker: WorkerView) -> None:
        self.worker = worker
        self.early: EarlyOffer | None = None  # a step offered before it was written
        self.memory_written = False  # a memory save persisted after the trainer's death
        self._room: bool | None = None  # the default hold's check, once

    def hold_seconds(self) -> float:
        """How long to keep the memory for a new engine once the trainer is gone (0: not).
        The default hold (``hot_hold_auto``) only where the node has room for a new trainer
        to stage as much again beside it; said in the log when it has not."""
        cfg = self.worker.config
        if cfg.hot_hold_s <= 0 or not cfg.hot_hold_auto:
            return max(cfg.hot_hold_s, 0.0)
        if self._room is None:
            held = sum(int(t.nbytes) for t in self.worker.arenas.values())
            try:
                check_memory(held)
                self._room = True
            except MemoryError as e:  # (StagingMemoryError)
                self._room = False
                log.warning(
                    "the trainer is gone: not keeping its memory for a new engine (rank %d; "
                    "the node has no room for a new trainer's staging beside the %.2f GiB it "
                    "holds: %s); a new engine reads the step from disk",
                    cfg.rank,
                    held / 2**30,
                    e,
                )
        return cfg.hot_hold_s if self._room else 0.0

    def before_write(self, job: SaveJob) -> None:
        """Offer a step persisted after the trainer's death before writing it
        (``offer_staged``): plain DCP tensors staged whole, ranks of one root (not node-local
        nor a recovery)."""
        cfg = self.worker.config
        one_root = cfg.dist is None or not (cfg.dist.ranks_per_node or cfg.dist.recovery_store)
        if not self.worker.trainer_gone:
            return
        self.memory_written = self.memory_written or job.tier == "memory"
        if not one_root or not self._holds():
            return
        plain = cfg.fmt == "dcp" and job.chunks is None and not (job.extra or {}).get("shards")
        if self.early is None and plain:
            self.early = self.offer_staged(job)

    def after_write(self, job: SaveJob) -> None:
        if (early := self.offered(job)) is not None:
            early.unchanged()  # the files hold the bytes offered, or no commit

    def manifest(self, job: SaveJob) -> dict[str, Any]:
        """One rank: ``offered``, the checksums of a step offered before it was written (the
        new engine checks them at its start; several ranks: ``offered_ranks``, worker/loop.py)."""
        early = self.offered(job) if self.worker.config.dist is None else None
        return {"offered": early.checksums()} if early is not None else {}

    def failed(self, job: SaveJob, why: str) -> None:
        if (early := self.offered(job)) is not None:
            early.withdraw(why)  # (a new engine that took it fails its start)

    def close(self, release_lock: Callable[[], None]) -> None:
        """The trainer is gone: what it wrote stays in memory a while for a new engine."""
        if self.worker.trainer_gone and self._holds():
            self.serve(self.hold_seconds(), release_lock)

    def _holds(self) -> bool:
        # The default hold: only for a step the disk did not have at the death (memory).
        auto = self.worker.config.hot_hold_auto
        return (self.memory_written or not auto) and self.hold_seconds() > 0

    def offered(self, job: SaveJob) -> EarlyOffer | None:
        """The early offer of ``job``'s step, or None."""
        early = self.early
        return early if early is not None and early.offer.step == job.step else None

    def checksums(self, job: SaveJob) -> dict[str, int] | None:
        """The checksums of ``job``'s step if it was offered before it was written, or None."""
        early = self.offered(job)
        return early.checksums() if early is not None else None

    def make_offer(
        self, written: Written | None = None
    ) -> tuple[Offer, list[int], memoryview | None] | None:
        """The offer of ``written`` (default: the newest step the worker committed), the
        arenas' descriptors and the largest tensor's bytes (for the ``corrupt`` fault: several
        ranks write a tensor they all hold once, a rank's own tensors are its largest); None
        when it wrote nothing or its arenas went."""
        worker = self.worker
        written = written if written is not None else worker.last_written
        if written is None:
            return None
        job = written.job
        fds: list[int] = []
        sizes: list[int] = []
        bases: list[int] = []
        for arena_id in job.arena_ids:
            arena = worker.arenas.get(arena_id)
            if arena is None:
                return None  # dropped by the trainer (a new layout): not this step's bytes
            fd, size = arena.untyped_storage()._share_fd_cpu_()[-2:]
            fds.append(fd)
            sizes.append(int(size))
            bases.append(int(arena.storage_offset()))
        specs = worker.job_specs(job)
        tensors = {s.fqn: (s.arena, bases[s.arena] + s.offset, s.nbytes) for s in specs}
        largest: memoryview | None = None
        if specs and (s := max(specs, key=lambda spec: spec.nbytes)).nbytes:
            largest = self._arena_bytes(job, s)
        config = worker.config
        offer = Offer(job.step, config.rank, written.files, tensors, tuple(sizes), os.getpid())
        offer.world_size = config.dist.world_size if config.dist is not None else 1
        return offer, fds, largest

    def serve(self, hold_s: float, release_lock: Callable[[], None]) -> None:
        """Offer the newest step the worker wrote for ``hold_s`` seconds, to one new engine;
        ``release_lock`` lets the new engine start (called once the socket listens, or at
        once when there is nothing to offer). An offer made while committing
        (``before_write``) that was not withdrawn is the one served."""
        early = self.early
        if early is not None and early.live():
            release_lock()  # committed: a new engine may start (and check what it took)
            early.hold(hold_s)
            return
        made = self.make_offer()
        if made is None:
            release_lock()
            return
        offer, fds, largest = made
        if early is not None:  # withdrawn: the other ranks may wait for this rank's "no"
            offer.vote = self.worker.config.dist
        payload = _encoded(offer)
        if payload is None:
            release_lock()
            return
        faults.point("before_hot_serve", largest)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(socket_name(self.worker.root, self.worker.config.rank))
        except OSError as e:  # another process offers this rank's memory: not this one's turn
            log.warning("cannot offer step %d to a new engine: %s", offer.step, e)
            sock.close()
            release_lock()
            return
        sock.listen(4)
        release_lock()  # listening first: a new engine that got the lock finds the offer
        log.warning(
            "the trainer is gone: offering step %d (rank %d) from memory to a new engine on "
            "this node for %.0fs",
            offer.step,
            offer.rank,
            hold_s,
        )
        deadline = time.monotonic() + hold_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    conn, _ = sock.accept()
                except TimeoutError:
                    break
                with conn:
                    if _hand_over(conn, payload, fds, offer.step):
                        log.info("step %d was taken from memory by a new engine", offer.step)
                        return
            log.warning("nobody took step %d from memory in %.0fs: freed", offer.step, hold_s)
        finally:
            sock.close()

    def offer_staged(self, job: SaveJob) -> EarlyOffer | None:
        """Offer ``job``'s step before a byte of it is written: each tensor's dtype, shape
        and CRC-32C computed here from the staged memory, and the objects and paths a load
        needs, so a new engine reads no file. None (logged) when it cannot be offered: the
        offer after the commit is then the only one."""
        made = self.make_offer(Written(job, ()))
        if made is None:
            return None
        offer, fds, largest = made
        specs = self.worker.job_specs(job)
        views = {s.fqn: self._arena_bytes(job, s) for s in specs}
        crcs = tensor_crcs(views)
        offer.staged = {s.fqn: (s.dtype, tuple(s.shape), crcs[s.fqn]) for s in specs}
        offer.objects, offer.paths = dict(job.objects), job.paths
        offer.vote = self.worker.config.dist
        payload = _encoded(offer)
        if payload is None:
            return None
        faults.point("before_hot_serve", largest)  # (after the checksums: a change is caught)
        early = EarlyOffer(offer, payload, fds, views)
        if not early.listen(socket_name(self.worker.root, offer.rank)):
            return None
        log.warning(
            "the trainer is gone: offering step %d (rank %d) from memory to a new engine on "
            "this node before it is written",
            offer.step,
            offer.rank,
        )
        return early

    def _arena_bytes(self, job: SaveJob, spec: TensorSpec) -> memoryview:
        arena = self.worker.arenas[job.arena_ids[spec.arena]]
        view = memoryview(arena.numpy()).cast("B")  # type: ignore[arg-type]
        return view[spec.offset : spec.offset + spec.nbytes]


def _encoded(offer: Offer) -> bytes | None:
    """``offer`` as it goes on the socket (hot_offer.py), or None (logged: not offered)."""
    try:
        return encode_offer(offer)
    except ValueError as e:
        log.warning("cannot offer step %d to a new engine: %s", offer.step, e)
        return None


def _hand_over(conn: socket.socket, payload: bytes, fds: list[int], step: int) -> bool:
    """Send the encoded offer and the descriptors; True once the client said it mapped them.
    A process of another user gets nothing; one whose answer is not ``TAKEN`` took nothing."""
    try:
        if peer_uid(conn) != os.getuid():
            log.warning("a process of another user asked for step %d's memory: refused", step)
            return False
        conn.settimeout(CLIENT_TIMEOUT_S)
        socket.send_fds(conn, [HEADER.pack(MAGIC, len(payload))], fds)
        conn.sendall(payload)
        return conn.recv(1) == TAKEN
    except OSError as e:
        log.warning("handing step %d over to a new engine failed: %s", step, e)
        return False


def tensor_crcs(views: dict[str, memoryview], threads: int = 4) -> dict[str, int]:
    """The CRC-32C of each tensor's bytes, by a few threads (the checksum releases the GIL)."""
    if threads < 2 or len(views) < 2:
        return {k: checksum(v) for k, v in views.items()}
    with ThreadPoolExecutor(threads, thread_name_prefix="asyncckpt-crc") as pool:
        return dict(zip(views, pool.map(checksum, views.values()), strict=True))


#: How long a withdrawal waits for the offer's socket to stop listening.
UNBIND_WAIT_S = 2.0


class EarlyOffer:
    """An offer served on a thread of its own while the main thread writes and commits its
    step (``payload``: the offer encoded). ``views``: the offered tensors' bytes, checked
    again once written (``unchanged``)."""

    def __init__(
        self, offer: Offer, payload: bytes, fds: list[int], views: dict[str, memoryview]
    ) -> None:
        self.offer, self.payload, self.fds, self.views = offer, payload, fds, views
        self.sock: socket.socket | None = None
        self.stop = threading.Event()
        self.taken = threading.Event()
        self.done = threading.Event()  # the thread ended
        # The socket no longer listens: the name is free for the next offer (after a
        # withdrawal, the committed step's), which would otherwise fail to bind.
        self.unbound = threading.Event()
        self.withdrawn = False
        self.thread = threading.Thread(target=self._run, name="asyncckpt-hot", daemon=True)

    def listen(self, name: str) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(name)
        except OSError as e:  # another process offers this rank's memory: not this one's turn
            log.warning("cannot offer step %d to a new engine: %s", self.offer.step, e)
            sock.close()
            return False
        sock.listen(4)
        sock.settimeout(0.1)  # (to see ``stop``)
        self.sock = sock
        self.thread.start()
        return True

    def checksums(self) -> dict[str, int]:
        """What the commit records (the manifest's ``offered``): each tensor's CRC-32C."""
        assert self.offer.staged is not None
        return {fqn: crc for fqn, (_, _, crc) in self.offer.staged.items()}

    def unchanged(self) -> None:
        """Once the files are written from the staged memory: it still holds the bytes
        offered (so the files do), else ``StagedMemoryChanged`` fails the save (nothing that
        differs from what a new engine may have loaded is committed)."""
        now = tensor_crcs(self.views)
        changed = sorted(k for k, crc in self.checksums().items() if now.get(k) != crc)
        if changed:
            raise StagedMemoryChanged(
                f"step {self.offer.step}: the staged memory changed after it was offered to a "
                f"new engine ({changed[:3]}): not committed"
            )

    def live(self) -> bool:
        """Not withdrawn (taken already, or still offered)."""
        return not self.withdrawn and (self.taken.is_set() or self.thread.is_alive())

    def withdraw(self, why: str) -> None:
        """The commit failed (``why``): nobody else takes the step (one who did finds out at
        its start)."""
        self.withdrawn = True
        self.stop.set()
        self.unbound.wait(UNBIND_WAIT_S)  # (the thread sees ``stop`` within its 0.1 s accept)
        log.warning(
            "step %d did not commit (%s): no longer offered from memory", self.offer.step, why
        )

    def hold(self, hold_s: float) -> None:
        """Until taken (and read) or ``hold_s`` seconds passed, then close."""
        if not self.taken.is_set() and not self.taken.wait(hold_s):
            log.warning("nobody took step %d from memory in %.0fs: freed", self.offer.step, hold_s)
        else:
            log.info("step %d was taken from memory by a new engine", self.offer.step)
        self.stop.set()
        self.done.wait(LOAD_TIMEOUT_S)

    def _run(self) -> None:
        assert self.sock is not None
        try:
            while not self.stop.is_set():
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    continue
                with conn:
                    if not _hand_over(conn, self.payload, self.fds, self.offer.step):
                        continue
                    self.taken.set()
                    self._unbind()  # one taker: the name is free while it reads
                    _until_done(conn)
                    return
        finally:
            self._unbind()
            self.done.set()

    def _unbind(self) -> None:
        assert self.sock is not None
        self.sock.close()
        self.unbound.set()


class StagedMemoryChanged(RuntimeError):
    """The memory of a step offered before it was written changed before it was written."""


def _until_done(conn: socket.socket) -> None:
    """Until the client said it is done reading the memory (or hung up)."""
    try:
        conn.settimeout(LOAD_TIMEOUT_S)
        conn.recv(1)
    except OSError:
        pass
