"""The worker's side of a hot resume (``MemoryTier(hold_seconds=)``; hot.py is the trainer's).

When its trainer dies, a worker finishes what it was writing (staged saves, the memory
checkpoint it held: worker.py, memory_hold.py). Every byte of the newest step it wrote is then
committed and still lies in the shared staging arenas, which nobody writes any more. Instead of
exiting, the worker offers that step for ``hold_seconds`` over a local socket named after the
root and the rank (an abstract Unix socket: this node only, this user only), so that a new
engine of the same rank reads it from memory instead of the disk. It releases the worker lock
first (it writes nothing more): the new engine starts as it would after a plain exit.

What travels: the step, the files this rank wrote for it, where each tensor's bytes lie in the
arenas, and the arenas' shared-memory file descriptors (``SCM_RIGHTS``). The new engine maps
them and checks every byte it copies against the committed manifest; nothing offered here is
trusted beyond being a place to copy from. The offer goes once: the memory is freed when the
new engine unmaps it (or when this process exits, at ``hold_seconds``, if nobody came).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import faults

log = logging.getLogger("asyncckpt")

#: The first bytes of an offer: the length of the pickled ``Offer`` that follows.
HEADER = struct.Struct("<Q")
#: SO_PEERCRED's ``struct ucred``: pid, uid, gid.
UCRED = struct.Struct("3i")
#: How long one client may take to read the offer before the next one is served.
CLIENT_TIMEOUT_S = 10.0


def socket_name(root: str | os.PathLike, rank: int) -> str:
    """The abstract socket a surviving worker of ``rank`` on ``root`` listens on."""
    key = hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:20]
    return f"\0asyncckpt-hot-{key}-{rank}"


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of ``conn``."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    return UCRED.unpack(raw)[1]


@dataclass
class Offer:
    """A step a surviving worker holds: what a new engine needs to map and find its bytes."""

    step: int
    rank: int
    files: tuple[str, ...]  # the files this rank wrote for the step (their records hold it)
    tensors: dict[str, tuple[int, int, int]]  # DCP key -> (arena index, byte offset, nbytes)
    sizes: tuple[int, ...]  # each arena's bytes (one descriptor each, in this order)
    pid: int


@dataclass
class Written:
    """What a worker wrote last: the job (its arenas, its specs) and this rank's files."""

    job: Any
    files: tuple[str, ...]


def make_offer(worker: Any) -> tuple[Offer, list[int], memoryview | None] | None:
    """The offer of the newest step ``worker`` wrote, the arenas' descriptors and the largest
    tensor's bytes (for the ``corrupt`` fault: several ranks write a tensor they all hold
    once, a rank's own tensors are its largest); None when it wrote nothing or its arenas
    went."""
    written: Written | None = worker.last_written
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
        sizes.append(size)
        bases.append(arena.storage_offset())
    specs = worker._specs(job)
    tensors = {s.fqn: (s.arena, bases[s.arena] + s.offset, s.nbytes) for s in specs}
    largest: memoryview | None = None
    if specs and (s := max(specs, key=lambda spec: spec.nbytes)).nbytes:
        arena = worker.arenas[job.arena_ids[s.arena]]
        largest = memoryview(arena.numpy()).cast("B")[s.offset : s.offset + s.nbytes]
    offer = Offer(job.step, worker.config.rank, written.files, tensors, tuple(sizes), os.getpid())
    return offer, fds, largest


def serve(worker: Any, hold_s: float, release_lock: Callable[[], None]) -> None:
    """Offer the newest step ``worker`` wrote for ``hold_s`` seconds, to one new engine;
    ``release_lock`` lets the new engine start (called once the socket listens, or at once
    when there is nothing to offer)."""
    made = make_offer(worker)
    if made is None:
        release_lock()
        return
    offer, fds, largest = made
    faults.point("before_hot_serve", largest)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(socket_name(worker.root, worker.config.rank))
    except OSError as e:  # another process offers this rank's memory: not this one's turn
        log.warning("cannot offer step %d to a new engine: %s", offer.step, e)
        sock.close()
        release_lock()
        return
    sock.listen(4)
    release_lock()  # listening first: a new engine that got the lock finds the offer
    log.warning(
        "the trainer is gone: offering step %d (rank %d) from memory to a new engine on this "
        "node for %.0fs",
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
                if _hand_over(conn, offer, fds):
                    log.info("step %d was taken from memory by a new engine", offer.step)
                    return
        log.warning("nobody took step %d from memory in %.0fs: freed", offer.step, hold_s)
    finally:
        sock.close()


def _hand_over(conn: socket.socket, offer: Offer, fds: list[int]) -> bool:
    """Send ``offer`` and the descriptors; True once the client said it mapped them."""
    try:
        if peer_uid(conn) != os.getuid():
            return False  # another user's process: not for it
        conn.settimeout(CLIENT_TIMEOUT_S)
        payload = pickle.dumps(offer, protocol=pickle.HIGHEST_PROTOCOL)
        socket.send_fds(conn, [HEADER.pack(len(payload))], fds)
        conn.sendall(payload)
        return conn.recv(1) == b"T"
    except OSError as e:
        log.warning("handing step %d over to a new engine failed: %s", offer.step, e)
        return False
