"""The memory tier replicated to a peer node (``MemoryTier(replicas=1)``): between workers only.

A node dies with its workers, and with them the memory checkpoints they held. With
``replicas=1`` every worker sends each memory save it holds to one peer worker on another
node -- the same local rank on node ``(n + 1) % nodes`` (``peer_rank``) -- which holds it in
its own memory. The trainer never waits for it: the ``Hold`` reaches the worker as before
(one local copy is the stall); the worker's ``ReplicaSender`` thread sends it and reports
``Replicated`` to the trainer, where ``handle.replicated()`` waits for it.

Transport: a TCP connection per pair, the receiver's address published in the side store
(``asyncckpt/<token>/replica/<rank>``). A replica is a header (the ``SaveJob`` with its specs
and paths: what writing that rank's files as that rank would takes; as JSON data and byte
segments, jobwire.py says field by field what travels, framing.py how), the receiver's
go-ahead (or its refusal: no memory for it), the arenas' bytes, an end mark and a CRC-32C of
each arena (checked before the replica is held). Nothing from the wire is unpickled, and
nothing is read before the peer proved it belongs to the run: every connection starts with
framing.py's handshake over the run's secret (``DistConfig.secret``), the receiver proving it
to the sender too (the address in the side store could be anybody's). A connection refused
(logged: who, why) changes nothing the run holds: not ``gone``, not ``connected``, no replica
held or dropped. The receiver reads into buffers of its own that hold no replica the sender
still keeps (the header's ``keep``; those it let go of are reused) and swaps them in only once
all of it came and checked: a sender that dies mid-transfer, or a replica damaged on the way,
leaves the replicas the sender still keeps, never a torn one. A sender whose slot is released
mid-transfer (the trainer needs it for a newer save) aborts the transfer the same way before
the slot is let go (``ReplicaSender.release``).

What a node holds: per rank, its two memory slots, and two replica buffers of the rank it
receives from (the two steps that rank holds: the newest and the one common to every rank),
so with equal shards four times a rank's state. Checked when the first memory save allocates
(``memory_tier.check_memory_tier``) and again by the receiver before it allocates.

Recovery (shared storage): when the trainers die, every surviving worker persists what it
holds as before (``memory_hold.persist_held``), and for each peer whose worker is gone it
starts a stand-in process (stand_in.py, a plain child process: the replica's bytes live in
shared files handed over by descriptor) that joins the workers' exchange and the save's group
*as that rank*, with the replica (``standing_in``). Who speaks for a rank is decided once in the
side store (``claim``): the rank's own worker or the holder of its replica, never both. The
side store of the recovery is a FileStore on the shared root (``recovering``), not rank 0's
worker's TCPStore: node 0 may be the node that died (node-local roots, with no shared path:
a second store the holder of rank 0's replica serves, recovery_store.py). The
newest step every rank (or its replica) holds is written (``which_step_to_persist``) by the
usual commit, or nothing.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import torch

from asyncckpt import faults
from asyncckpt.cluster import dist as _dist
from asyncckpt.cluster.dist import DistConfig
from asyncckpt.cluster.framing import (
    AuthError,
    Message,
    expect,
    handshake_client,
    handshake_server,
    listen,
    recv_exact,
    recv_into,
    recv_msg,
    send_msg,
)
from asyncckpt.cluster.local_recovery import replica_root
from asyncckpt.cluster.recovery_store import BackupStore
from asyncckpt.core import layout as _layout
from asyncckpt.core import messages as M
from asyncckpt.errors import StagingMemoryError
from asyncckpt.memory.jobwire import NotReplicable, decode_replica, encode_replica
from asyncckpt.memory.service import Settings, WorkerService, WorkerSettings

# (its check_memory looked up when used: tests replace it)
from asyncckpt.staging import arenas as staging
from asyncckpt.storage.manifest import checksum

log = logging.getLogger("asyncckpt")

#: How long the holder of a peer's replica waits for that peer's own worker to speak for its
#: rank at the trainers' death before standing in for it (a worker whose connection ended is
#: known dead at once).
CLAIM_WAIT_S = 10.0
#: Bytes sent per piece: a release waits at most for one piece in flight.
CHUNK = 8 << 20
_END = b"ASYNCCKPT-REPLICA-END"
#: What a replica connection's handshake proves (framing.py): the run's secret, for this use.
SERVICE = "replica"
#: The module a stand-in runs (``python -m``): stand_in.py.
STAND_IN_MODULE = "asyncckpt.worker.stand_in"


@dataclass(frozen=True)
class ReplicaConfig:
    """What a worker needs for ``replicas=1`` (picklable, in ``WorkerConfig.replication``):
    the rank it sends its memory saves to and the rank whose saves it receives."""

    peer: int
    source: int


def peer_rank(rank: int, node_rank: int, ranks_per_node: int, nodes: int) -> int:
    """The rank that holds ``rank``'s replica: the same local rank on the next node."""
    local = rank - node_rank * ranks_per_node
    return ((node_rank + 1) % nodes) * ranks_per_node + local


def source_rank(rank: int, node_rank: int, ranks_per_node: int, nodes: int) -> int:
    """The rank whose replica ``rank`` holds: the same local rank on the previous node."""
    local = rank - node_rank * ranks_per_node
    return ((node_rank - 1) % nodes) * ranks_per_node + local


def which_step_to_persist(
    held_by_rank: Mapping[int, Iterable[int]],
    replicas_held: Mapping[int, Iterable[int]],
    world_size: int,
) -> int | None:
    """The memory step to write when the trainers died: the newest that every rank holds,
    each rank through its own worker (``held_by_rank``, the surviving ones) or else through
    the replica of it a peer holds (``replicas_held``); None when a rank has neither, or no
    step is common. A rank's own worker wins over its replica."""
    sets = []
    for r in range(world_size):
        steps = held_by_rank.get(r)
        if steps is None:
            steps = replicas_held.get(r)
        if steps is None:
            return None
        sets.append(set(steps))
    common = set(sets[0]).intersection(*sets[1:]) if sets else set()
    return max(common) if common else None


# ------------------------------------------------------------------ the side store


def _key(token: str, what: str) -> str:
    return f"asyncckpt/{token}/replica/{what}"


def _store(cfg: DistConfig, timeout: float | None = None) -> Any:
    return _dist.side_store(cfg, timeout)  # (looked up when used: tests replace it)


def recovering(config: Settings, replication: Replication | None = None) -> Settings:
    """A worker's config for the recovery at its trainer's death: with replicas, every rank's
    worker (and stand-in) agrees over a FileStore on the shared root instead of rank 0's
    store, which dies with node 0. Every rank switches at the same moment (its trainer's
    death), so no two agree over different stores. Node-local roots have no root every node
    sees: rank 0's store while it answers, else the second store served by the holder of rank
    0's replica (recovery_store.py)."""
    if config.replication is None or config.dist is None:
        return config
    if config.dist.ranks_per_node:
        backup = replication.backup if replication is not None else None
        return backup.recovering(config) if backup is not None else config
    path = os.path.join(config.root, _layout.recovery_store_name(config.dist.token))
    return replace(config, dist=replace(config.dist, recovery_store=path))


def claim(cfg: DistConfig, rank: int, who: str) -> str:
    """Say once, for every process, who speaks for ``rank`` in the exchange at the trainers'
    death (``"self"`` or ``"replica:<holder rank>"``); returns whoever did first."""
    store = _store(cfg, min(cfg.timeout, 60.0))
    return store.compare_set(_key(cfg.token, f"claim/{rank}"), "", who).decode()


def claimed(store: Any, token: str, rank: int) -> bool:
    return store.check([_key(token, f"claim/{rank}")])


def _my_address(cfg: DistConfig) -> str:
    """The address peers reach this machine on: ``$ASYNCCKPT_REPLICA_HOST``, else the local
    address of a route to the side store's host. A worker's listeners (its replica receiver,
    its second side store, its trainer's node-local replica server) bind it and publish it."""
    host = os.environ.get("ASYNCCKPT_REPLICA_HOST")
    if host:
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((cfg.host, cfg.port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _bytes_of(arena: torch.Tensor) -> memoryview:
    return memoryview(arena.numpy()).cast("B")  # type: ignore[arg-type]


# ------------------------------------------------------------------ the sender's side


class ArenaRegistry:
    """The arenas and specs the trainer sent (noted by the worker's reader thread as they
    arrive), for the sender, which runs beside the main loop."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.arenas: dict[int, Any] = {}
        self.specs: dict[tuple[int, ...], list] = {}

    def note(self, msg: Any) -> None:
        with self.cond:
            if isinstance(msg, M.Arena):
                self.arenas[msg.arena_id] = msg.tensor
            elif isinstance(msg, M.Specs):
                self.specs[tuple(msg.arena_ids)] = msg.specs
            elif isinstance(msg, M.Drop):
                self.arenas.pop(msg.arena_id, None)
                self.specs = {k: v for k, v in self.specs.items() if msg.arena_id not in k}
            else:
                return
            self.cond.notify_all()

    def get(self, job: Any, timeout: float) -> tuple[list[Any], list]:
        """The job's arenas and specs (they reach the worker on another pipe than its Hold)."""
        ids = tuple(job.arena_ids)
        with self.cond:
            ok = self.cond.wait_for(
                lambda: (
                    all(a in self.arenas for a in ids)
                    and (job.specs is not None or ids in self.specs)
                ),
                timeout,
            )
            if not ok:
                raise RuntimeError(f"memory job {job.job_id}: its arenas never arrived")
            specs = job.specs if job.specs is not None else self.specs[ids]
            return [self.arenas[a] for a in ids], specs


@dataclass
class _Offer:
    job: Any
    keep: list[int]  # the other steps the sender still holds (the receiver keeps those)


class ReplicaSender:
    """A worker's thread that sends the newest memory save it holds to its peer's receiver
    and reports ``Replicated`` (or why not) to the trainer. Only the newest offer waits: an
    older one not yet begun is superseded."""

    def __init__(self, cfg: DistConfig, rep: ReplicaConfig, registry: ArenaRegistry, events: Any):
        self.cfg = cfg
        self.rep = rep
        self.registry = registry
        self.events = events
        self.cond = threading.Condition()
        self.pending: _Offer | None = None
        self.sending: int | None = None  # the job taken from ``pending``, until its send ends
        self.reading: int | None = None  # the job whose slot is being read
        # jobs whose slot was released while their send was under way: never read again
        self.cancelled: set[int] = set()
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, name="asyncckpt-replicate", daemon=True)
        self.thread.start()

    def offer(self, job: Any, keep: list[int]) -> None:
        with self.cond:
            old, self.pending = self.pending, _Offer(job, keep)
            self.cond.notify_all()
        if old is not None:
            self._report(old.job.job_id, f"superseded by step {job.step} before it was sent")

    def release(self, job_id: int) -> None:
        """The slot of memory job ``job_id`` is about to be let go: stop reading from it (a
        transfer under way is cut off: the receiver keeps its previous replica)."""
        with self.cond:
            if self.sending == job_id:
                self.cancelled.add(job_id)  # dropped when its send ends
            if self.pending is not None and self.pending.job.job_id == job_id:
                self.pending = None
                self._report(job_id, "its slot was released before it was sent")
            # Until its send is over, whatever stage it is at (waiting for the receiver's
            # "ready" too): the caller reuses the slot once this returns.
            if self.sending == job_id:
                sock = self.sock
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                self.cond.wait_for(lambda: self.sending != job_id, 30.0)

    def _report(self, job_id: int, error: str | None) -> None:
        self.events.send(M.Replicated(job_id, error))

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending is not None)
                offer, self.pending = self.pending, None
                assert offer is not None
                self.sending = offer.job.job_id
            error: str | None
            try:
                error = self._send(offer)
            except Exception as e:  # noqa: BLE001 - reported on the handle; next one reconnects
                error = f"{type(e).__name__}: {e}"
                self._close()
            finally:
                with self.cond:
                    self.cancelled.discard(offer.job.job_id)
                    self.reading = self.sending = None
                    self.cond.notify_all()
            if error is not None:
                log.warning(
                    "memory save of step %d not replicated to rank %d: %s",
                    offer.job.step,
                    self.rep.peer,
                    error,
                )
            self._report(offer.job.job_id, error)

    def _connect(self) -> socket.socket:
        if self.sock is None:
            store = _store(self.cfg, min(self.cfg.timeout, 60.0))
            raw = store.get(_key(self.cfg.token, f"addr/{self.rep.peer}")).decode()
            host, port = raw.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=self.cfg.timeout)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:  # (the address came from the side store: anybody could have put it there)
                    handshake_client(sock, self.cfg.secret, SERVICE)
                except AuthError as e:
                    raise AuthError(f"rank {self.rep.peer}'s receiver at {raw}: {e}") from None
                send_msg(sock, {"kind": "hello", "rank": self.cfg.rank})
                welcome = expect(recv_msg(sock), "welcome").header.get("rank")
                if welcome != self.rep.peer:
                    raise ConnectionError(
                        f"{raw} is rank {welcome}'s receiver, not {self.rep.peer}'s"
                    )
            except BaseException:
                sock.close()
                raise
            with self.cond:
                self.sock = sock
        return self.sock

    def _close(self) -> None:
        with self.cond:
            sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _send(self, offer: _Offer) -> str | None:
        """One replica: header, the receiver's go, the bytes, the end mark, its answer."""
        job = offer.job
        arenas, specs = self.registry.get(job, 60.0)
        sizes = [int(a.numel()) for a in arenas]
        try:
            header, segments = encode_replica(job, list(specs), sizes, offer.keep)
        except NotReplicable as e:  # the save stands; its handle says why it has no replica
            return str(e)
        sock = self._connect()
        send_msg(sock, header, segments)
        answer = expect(recv_msg(sock), "ready", "refused")
        if answer.kind != "ready":
            return _why(answer)
        with self.cond:
            if job.job_id in self.cancelled:
                self._close()  # the receiver waits for bytes that never come: start afresh
                return "its slot was released before it was sent"
            self.reading = job.job_id
        faults.point_of(job.faults, "mid_replication")
        crcs = []
        for arena in arenas:
            view, crc = _bytes_of(arena), 0
            for i in range(0, len(view), CHUNK):
                piece = view[i : i + CHUNK]
                crc = checksum(piece, crc)  # of the bytes sent, as they are sent
                sock.sendall(piece)
            crcs.append(crc)
        with self.cond:
            self.reading = None  # every byte is out of the slot
            self.cond.notify_all()
        sock.sendall(_END)
        send_msg(sock, {"kind": "crcs", "crcs": crcs})
        answer = expect(recv_msg(sock), "held", "damaged")
        return None if answer.kind == "held" else _why(answer)


def _why(answer: Message) -> str:
    """The receiver's reason for not holding a replica, as it said it."""
    return str(answer.header.get("why", f"the receiver said {answer.kind!r}"))


# ------------------------------------------------------------------ the receiver's side


def _anonymous_file() -> int:
    """A descriptor of a file in memory and without a name (nothing left to clean when the
    node dies); an unlinked temporary file where memfd is missing."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("asyncckpt-replica", os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as f:
        return os.dup(f.fileno())


def map_shared(fd: int, nbytes: int) -> Any:
    """A uint8 tensor over the shared file ``fd`` (every process mapping it sees the same
    bytes); it keeps the mapping alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)


class SharedBuffer:
    """Replica bytes in a shared file of their own: a stand-in process maps the same memory
    by its descriptor (``spawn_stand_in``). The descriptor is closed with the tensor."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fd = _anonymous_file()
        try:
            os.ftruncate(self.fd, nbytes)
            self.tensor = map_shared(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        weakref.finalize(self, os.close, self.fd)


@dataclass
class Replica:
    """A peer rank's memory save, held whole: its job (arena ids renumbered to ``arenas``)."""

    job: Any
    arenas: dict[int, SharedBuffer] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.arenas.values())


class ReplicaReceiver:
    """A worker's listener for its source peer's replicas: each held whole or not at all."""

    def __init__(self, cfg: DistConfig, rep: ReplicaConfig) -> None:
        if not cfg.secret:
            raise ValueError("a replica receiver needs the run's secret (DistConfig.secret)")
        self.cfg = cfg
        self.rep = rep
        self.lock = threading.Lock()
        self.held: dict[int, Replica] = {}  # step -> the source's replica
        self.connected = False
        self.gone = threading.Event()  # the source's connection ended (its worker is gone)
        self.next_id = 0
        # Bound to the address it publishes (peers on the job's network reach it there), not
        # every interface.
        self.address = _my_address(cfg)
        self.listener = listen(self.address)
        threading.Thread(target=self._serve, name="asyncckpt-replicas", daemon=True).start()

    def _serve(self) -> None:
        try:
            port = self.listener.getsockname()[1]
            store = _store(self.cfg)
            store.set(_key(self.cfg.token, f"addr/{self.cfg.rank}"), f"{self.address}:{port}")
        except Exception as e:  # noqa: BLE001 - the peer's replicas then fail, saying so
            log.warning("rank %d cannot take replicas: %s", self.cfg.rank, e)
            return
        while True:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._connection,
                args=(sock, peer),
                name="asyncckpt-replica-in",
                daemon=True,
            ).start()

    def _connection(self, sock: socket.socket, peer: Any) -> None:
        """One sender's connection: the run's secret proven before anything is read, then
        its rank; a peer refused (logged: who, why) changes nothing the run holds."""
        with sock:
            try:
                handshake_server(sock, self.cfg.secret, SERVICE)
                hello = expect(recv_msg(sock), "hello")
                if hello.header.get("rank") != self.rep.source:
                    raise ConnectionError(f"it is not rank {self.rep.source}")
                send_msg(sock, {"kind": "welcome", "rank": self.cfg.rank})
            except (EOFError, OSError) as e:  # a stranger: nothing the run holds changes
                log.warning(
                    "rank %d refused a replica connection from %s: %s", self.cfg.rank, peer, e
                )
                return
            self.connected = True
            self.gone.clear()
            try:
                while True:
                    self._one(sock)
            except (EOFError, OSError):
                self.gone.set()  # mid-transfer or between: what is held stays whole

    def _one(self, sock: socket.socket) -> None:
        try:
            msg = recv_msg(sock, segment_room=lambda n: staging.check_memory(n))  # (objects)
        except StagingMemoryError as e:
            send_msg(sock, {"kind": "refused", "why": f"rank {self.cfg.rank} cannot hold it: {e}"})
            return
        job, sizes, keep = decode_replica(expect(msg, "replica"))
        with self.lock:  # the steps the source let go of go here too
            spare = [r for s, r in self.held.items() if s not in keep]
            self.held = {s: r for s, r in self.held.items() if s in keep}
        reuse = [b for r in spare for b in r.arenas.values()]
        arenas: dict[int, SharedBuffer] = {}
        try:
            need = sum(n for n in sizes) - sum(b.nbytes for b in reuse)
            if need > 0:
                staging.check_memory(need)
            ids = []
            for n in sizes:
                same = next((b for b in reuse if b.nbytes == n), None)
                if same is not None:
                    reuse.remove(same)
                else:
                    same = SharedBuffer(n)
                self.next_id += 1
                arenas[self.next_id] = same
                ids.append(self.next_id)
        except Exception as e:  # noqa: BLE001 - refused: the sender says so on its handle
            send_msg(sock, {"kind": "refused", "why": f"rank {self.cfg.rank} cannot hold it: {e}"})
            return
        del reuse
        send_msg(sock, {"kind": "ready"})
        for b in arenas.values():
            recv_into(sock, _bytes_of(b.tensor))
        if recv_exact(sock, len(_END)) != _END:
            raise EOFError("a replica without its end mark")
        # End to end: the sender's checksums of what it sent against the bytes held here (a
        # stand-in would commit a flipped bit with a manifest made from it: a silent error).
        sent = expect(recv_msg(sock), "crcs").header.get("crcs")
        got = [checksum(_bytes_of(b.tensor)) for b in arenas.values()]
        if not isinstance(sent, list) or sent != got:
            sent = sent if isinstance(sent, list) else []
            bad = [i for i, (a, b) in enumerate(zip(sent, got, strict=False)) if a != b]
            log.warning("rank %d's replica of step %d arrived damaged", self.rep.source, job.step)
            why = (
                f"rank {self.cfg.rank} received it damaged: arena(s) {bad} differ from the "
                "sender's checksums; not held"
            )
            send_msg(sock, {"kind": "damaged", "why": why})
            return
        job.arena_ids = ids
        with self.lock:
            self.held[job.step] = Replica(job, arenas)
        send_msg(sock, {"kind": "held", "job_id": job.job_id})

    def steps(self) -> list[int]:
        with self.lock:
            return sorted(self.held)

    def take(self) -> list[Replica]:
        with self.lock:
            held, self.held = self.held, {}
        return sorted(held.values(), key=lambda r: r.job.step, reverse=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()


class Replication(WorkerService):
    """A worker's two halves (``WorkerConfig.replication``): its sender and its receiver. As a
    worker's service, it notes the arenas the trainer sends for its sender (``on_message``)."""

    def __init__(self, cfg: DistConfig, rep: ReplicaConfig, events: Any) -> None:
        self.cfg = cfg
        self.rep = rep
        self.registry = ArenaRegistry()
        self.receiver = ReplicaReceiver(cfg, rep)
        self.sender = ReplicaSender(cfg, rep, self.registry, events)
        # Node-local roots: the store a recovery meets at if node 0 died.
        self.backup: BackupStore | None = None
        if cfg.ranks_per_node:
            self.backup = BackupStore(cfg, _my_address(cfg))

    def on_message(self, msg: object) -> bool:
        """On the worker's reader thread: its sender reads the arenas beside the main loop."""
        self.registry.note(msg)
        return False

    def source_is_gone(self, cfg: DistConfig, wait: float) -> bool:
        """Whether the source peer's worker is gone: its connection ended, or it did not
        speak for its own rank within ``wait`` seconds (a peer that hangs). ``cfg``: the
        side group's config at the recovery (``recovering``)."""
        store = _store(cfg, min(cfg.timeout, 60.0))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.receiver.gone.is_set():
                return True
            if claimed(store, cfg.token, self.rep.source):
                return False
            time.sleep(0.05)
        return not claimed(store, cfg.token, self.rep.source)

    def stand_in_jobs(self, cfg: DistConfig) -> list[Replica] | None:
        """At the trainers' death: the replica jobs to write as the source rank (with their
        arenas), if its worker is gone and this worker speaks for it; else None."""
        if not self.receiver.steps():
            return None
        if not self.source_is_gone(cfg, CLAIM_WAIT_S):
            return None
        who = claim(cfg, self.rep.source, f"replica:{self.cfg.rank}")
        if who != f"replica:{self.cfg.rank}":
            return None
        replicas = self.receiver.take()
        log.warning(
            "rank %d's worker is gone: rank %d stands in for it with its replicas of step(s) %s",
            self.rep.source,
            self.cfg.rank,
            [r.job.step for r in replicas],
        )
        return replicas


def stand_in_config(config: Settings, rank: int) -> Settings:
    """A worker's config, as the worker of ``rank`` (a stand-in writes that rank's files).
    On node-local roots it writes into the holder's root under ``.asyncckpt-replicas/node<n>``
    (``local_recovery.replica_root``): that rank's node's directory, committed there whole by
    the usual node commit, for a replacement node to fetch at load."""
    assert config.dist is not None  # (replicas: several ranks)
    dist = replace(config.dist, rank=rank, local_rank=config.dist.local_rank)
    root: str | Path = config.root
    if dist.ranks_per_node:
        root = replica_root(config.root, rank // dist.ranks_per_node)
    return replace(
        config,
        root=root,
        rank=rank,
        dist=dist,
        store_socket=None,
        replication=None,
    )


@contextlib.contextmanager
def standing_in(
    replication: Replication | None, config: WorkerSettings, entry: str = STAND_IN_MODULE
) -> Iterator[None]:
    """Around a worker's own persist at the trainers' death: the stand-ins it starts, waited
    for at the end (``start_stand_ins``)."""
    procs = start_stand_ins(replication, config, entry)
    try:
        yield
    finally:
        for proc in procs:
            try:
                code = proc.wait(config.orphan_deadline_s)
            except subprocess.TimeoutExpired:
                log.warning("the stand-in for rank %d did not finish in time", config.rank)
                continue
            if code != 0:
                log.warning("the stand-in (pid %d) exited with status %d", proc.pid, code)


def start_stand_ins(
    replication: Replication | None, config: WorkerSettings, entry: str = STAND_IN_MODULE
) -> list[subprocess.Popen]:
    """At the trainers' death: a process standing in for the source peer if its worker is
    gone, writing its part of the memory step as that rank would (``entry``: the module run
    with ``python -m``, ``stand_in.py``), or none."""
    if replication is None or config.dist is None:  # (replicas: several ranks)
        return []
    try:
        replicas = replication.stand_in_jobs(config.dist)
    except Exception as e:  # noqa: BLE001 - the store is gone: nobody can agree anyway
        log.warning("could not stand in for rank %d: %s", replication.rep.source, e)
        return []
    if not replicas:
        return []
    stand_in = stand_in_config(config, replication.rep.source)
    jobs = [r.job for r in replicas]
    buffers = {i: b for r in replicas for i, b in r.arenas.items()}
    return [spawn_stand_in(entry, stand_in, jobs, buffers)]


def spawn_stand_in(
    entry: str, config: WorkerSettings, jobs: list[Any], buffers: Mapping[int, SharedBuffer]
) -> subprocess.Popen:
    """A plain child process (a worker is a daemonic multiprocessing process, which may not
    have multiprocessing children): the replicas' shared files are handed over by descriptor
    (``pass_fds``), the rest pickled on its stdin after the worker's ``sys.path``."""
    # (found from the package, not from this file: its depth in the package is not fixed)
    here = os.path.dirname(
        os.path.dirname(os.path.abspath(sys.modules["asyncckpt"].__file__ or ""))
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env["ASYNCCKPT_STAND_IN_PARENT"] = str(os.getpid())  # (stand_in.PARENT_ENV: it watches us)
    fds = {i: (b.fd, b.nbytes) for i, b in buffers.items()}
    proc = subprocess.Popen(  # noqa: S603 - this interpreter, a module of this package
        [sys.executable, "-m", entry],
        stdin=subprocess.PIPE,
        pass_fds=[fd for fd, _ in fds.values()],
        env=env,
    )
    assert proc.stdin is not None
    with proc.stdin:
        pickle.dump(list(sys.path), proc.stdin)
        pickle.dump((config, jobs, fds), proc.stdin)
    return proc


def read_stand_in(stream: BinaryIO) -> tuple[Any, list[Any], dict[int, Any]]:
    """The stand-in's side of ``spawn_stand_in``: its config, its jobs and their arenas."""
    for path in reversed(pickle.load(stream)):  # noqa: S301 - from its parent worker
        if path not in sys.path:
            sys.path.insert(0, path)
    config, jobs, fds = pickle.load(stream)  # noqa: S301
    return config, jobs, {i: map_shared(fd, n) for i, (fd, n) in fds.items()}
