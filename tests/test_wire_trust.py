"""Issue 51, items 1 and 2 (invariant 17): the workers' TCP connections (a memory save's
replica to a peer node, the node-local fetch of a replica from a peer's disk) run nothing a
peer sends, act on nothing before the peer proved it belongs to the run, never open a name a
peer sends outside its destination, and listen on the address the node publishes only.

On main before this: a 60-byte pickle sent to either port ran code in the worker; a stranger's
``("hello", rank)`` then close marked the source's worker gone (which changes who stands in
for it); a stranger's ``"replica"`` with matching checksums was held, its ``keep`` list
dropping the real ones; the fetch wrote ``into / name`` for any name (``../x``, an absolute
path, ``../global_step_1/<file>`` truncating a committed file in place).
"""

from __future__ import annotations

import datetime
import os
import pickle
import secrets
import socket
import struct
import threading
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from asyncckpt import framing
from asyncckpt import layout as L
from asyncckpt import local_recovery as LR
from asyncckpt import messages as M
from asyncckpt import replication as R
from asyncckpt.dist import DistConfig
from asyncckpt.manifest import checksum
from asyncckpt.worker import SaveJob

SECRET = secrets.token_hex(32)
WILDCARDS = ("0.0.0.0", "::")


def _cfg(rank: int, port: int, secret: str = SECRET) -> DistConfig:
    return DistConfig(rank, 2, 0, "127.0.0.1", port, "tok", 30.0)


def _side_store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False
    )


class _Events:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.got: list = []

    def send(self, msg) -> None:
        with self.cond:
            self.got.append(msg)
            self.cond.notify_all()

    def replicated(self, job_id: int, timeout: float = 60.0) -> M.Replicated:
        def found():
            return next(
                (m for m in self.got if isinstance(m, M.Replicated) and m.job_id == job_id), None
            )

        with self.cond:
            assert self.cond.wait_for(lambda: found() is not None, timeout), self.got
            return found()


def _job(registry: R.ArenaRegistry, job_id: int, step: int, fill: int, **kw) -> SaveJob:
    arena = torch.full((1 << 16,), fill, dtype=torch.uint8)
    registry.note(M.Arena(100 + job_id, arena))
    return SaveJob(
        job_id=job_id,
        step=step,
        arena_ids=[100 + job_id],
        specs=[],
        objects={"step": b"run's own state"},
        paths={},
        metrics={},
        tier="memory",
        **kw,
    )


class _Run:
    """Rank 0's sender and rank 1's receiver of one run, rank 0's step 2 held by rank 1."""

    def __init__(self) -> None:
        self.store = _side_store()
        self.receiver = R.ReplicaReceiver(
            _cfg(1, self.store.port), R.ReplicaConfig(peer=0, source=0)
        )
        self.registry, self.events = R.ArenaRegistry(), _Events()
        self.sender = R.ReplicaSender(
            _cfg(0, self.store.port), R.ReplicaConfig(peer=1, source=1), self.registry, self.events
        )
        self.sender.offer(_job(self.registry, 1, 2, 7), [])
        assert self.events.replicated(1).error is None
        self.held = self.receiver.held[2]

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.receiver.listener.getsockname()[:2]
        return host, port

    def holds_what_it_held(self) -> bool:
        """Step 2 held, the same replica object, its bytes the sender's; nothing else."""
        if self.receiver.steps() != [2] or self.receiver.held[2] is not self.held:
            return False
        arena = next(iter(self.held.arenas.values())).tensor
        return bool((arena == 7).all())

    def close(self) -> None:
        self.receiver.close()
        self.sender._close()


@pytest.fixture
def run():
    r = _Run()
    yield r
    r.close()


class _Marker:
    """A pickle that creates a file when it is loaded: code run by whoever unpickles it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickled(obj) -> bytes:
    """A message as the workers framed them before: length, then the pickle."""
    data = pickle.dumps(obj)
    return struct.pack("!Q", len(data)) + data


def _talk(address: tuple[str, int], data: bytes, timeout: float = 30.0) -> bytes:
    """Send ``data`` as a stranger would, then read until the listener closes the connection;
    returns what it sent back."""
    got = bytearray()
    with socket.create_connection(address, timeout=timeout) as sock:
        with_errors_ignored(sock.sendall, data)
        with_errors_ignored(sock.shutdown, socket.SHUT_WR)
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    return bytes(got)


def with_errors_ignored(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass  # the listener closed first: what it read is what counts


def _guess_the_secret(address: tuple[str, int], then: bytes = b"") -> bytes:
    """A stranger that speaks the handshake without the secret: its opener, then a proof made
    with a key of its own, then ``then``; returns what the listener sent back."""
    got = bytearray()
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(framing.MAGIC + os.urandom(framing.NONCE_BYTES))
        with_errors_ignored(sock.sendall, os.urandom(framing.MAC_BYTES) + then)
        with_errors_ignored(sock.shutdown, socket.SHUT_WR)
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    return bytes(got)


# ------------------------------------------------------------------ the replica receiver


def test_a_strangers_pickle_to_the_replica_receiver_runs_nothing(run, tmp_path):
    ran = tmp_path / "ran"
    _talk(run.address, _pickled(_Marker(ran)))
    _talk(run.address, pickle.dumps(_Marker(ran)))  # (no length prefix)
    assert not ran.exists()
    assert run.holds_what_it_held()
    assert not run.receiver.gone.is_set()


def _crafted_replica(step: int, keep: list[int]) -> list[bytes]:
    """Today's messages of a replica of a stranger's making, checksums matching."""
    data = b"\x01" * 4096
    job = SaveJob(step, step, [1], [], {"evil": b"x"}, {}, {}, tier="memory")
    return [
        _pickled(("hello", 0)),
        _pickled(("replica", job, [len(data)], keep)),
        data + R._END + _pickled(("crcs", [checksum(data)])),
    ]


# ------------------------------------------------------------------ the replica's header


def _prepared_job(fmt: str, state: dict, **kw) -> tuple[SaveJob, list, list[int]]:
    from asyncckpt.formats.staged import prepare
    from asyncckpt.staging import plan_arenas

    part = prepare(fmt, state)
    specs, sizes = plan_arenas(part.tensors)
    job = SaveJob(
        job_id=4,
        step=12,
        arena_ids=[7],
        specs=None,
        objects=dict(part.objects),
        paths=dict(part.paths),
        metrics={"loss": 0.25, "nan": float("nan")},
        metadata={"note": ["a", 1]},
        extra=part.extra,
        attempt=2,
        figures={"stage_seconds": 0.5, "staged_bytes": 100},
        saved_at=1.5,
        tier="memory",
        digests={"w": b"0" * 16},
        held_as=3,
        **kw,
    )
    return job, specs, sizes


def _round_trip(job: SaveJob, specs: list, sizes: list[int], keep=(1,)) -> tuple:
    from asyncckpt import jobwire

    header, segments = jobwire.encode_replica(job, specs, sizes, list(keep))
    data = framing.encode_header({**header, "segments": [len(s) for s in segments]})
    msg = framing.Message(__import__("json").loads(data[4:]), list(segments))
    msg.header.pop("segments")
    return jobwire.decode_replica(msg)


STATE = {
    "model": {"w": torch.ones(3), "b": torch.zeros(2, 5, dtype=torch.bfloat16)},
    "step": 3,
    "opt": {"state": {0: {"m": torch.ones(2)}}, "groups": [{"lr": 0.1}]},
}


@pytest.mark.parametrize("fmt", ["dcp", "torch_dist"])
def test_a_replicas_header_travels_as_data_field_by_field(fmt):
    job, specs, sizes = _prepared_job(fmt, STATE)
    got, got_sizes, keep = _round_trip(job, specs, sizes)
    assert (got_sizes, keep) == (sizes, [1])
    assert got.specs == specs and got.objects == job.objects and got.extra == job.extra
    assert {k: [tuple(i) for i in p] for k, p in job.paths.items()} == got.paths
    assert got.paths["opt.state.0.m"][2] == ("d", 0)  # an int key stays an int
    for name in ("job_id", "step", "attempt", "metadata", "figures", "saved_at", "tier"):
        assert getattr(got, name) == getattr(job, name), name
    assert got.metrics["loss"] == 0.25 and got.metrics["nan"] != got.metrics["nan"]
    # what does not travel: the receiver's own ids, no policy, no fingerprints, no slot
    assert (got.arena_ids, got.prune, got.digests, got.held_as, got.faults) == (
        [],
        None,
        None,
        None,
        {},
    )


def test_what_cannot_travel_as_data_is_refused_on_the_sender_saying_why():
    from asyncckpt import jobwire
    from asyncckpt.formats import FORMAT_KEY
    from asyncckpt.formats.components import Component
    from asyncckpt.formats.components import prepare as components

    job, specs, sizes = _prepared_job("dcp", STATE)
    cases = {
        "registered by the user": {**job.extra, FORMAT_KEY: object()},
        "no wire form": {**job.extra, "something new": 1},
    }
    for why, extra in cases.items():
        with pytest.raises(jobwire.NotReplicable, match=why):
            jobwire.encode_replica(SaveJob(**{**job.__dict__, "extra": extra}), specs, sizes, [])
    pt, specs_pt, sizes_pt = _prepared_job("pt", {"x": 1, "w": torch.ones(2)})
    with pytest.raises(jobwire.NotReplicable, match="unpickle"):
        jobwire.encode_replica(pt, specs_pt, sizes_pt, [])
    mixed = components(
        {"actor": Component("dcp"), "extra": Component("pt", path="extra.pt")},
        {"actor": {"w": torch.ones(2)}, "extra": {"x": 1}},
        rank=0,
    )
    with pytest.raises(jobwire.NotReplicable, match="unpickle"):
        jobwire.encode_replica(SaveJob(**{**job.__dict__, "extra": mixed.extra}), specs, sizes, [])
    other_rank = components(  # (a pt part another rank writes: nothing to unpickle here)
        {"actor": Component("dcp"), "extra": Component("pt", path="extra.pt")},
        {"actor": {"w": torch.ones(2)}, "extra": {"x": 1}},
        rank=1,
    )
    got, _, _ = _round_trip(SaveJob(**{**job.__dict__, "extra": other_rank.extra}), specs, sizes)
    assert got.extra == other_rank.extra
    odd = [dataclasses_replace(specs[0], dtype=torch.qint8)]
    with pytest.raises(jobwire.NotReplicable, match="dtype"):
        jobwire.encode_replica(job, odd, sizes, [])


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_a_user_registered_format_is_refused_on_the_handle():
    """The memory save stands; its handle says why it has no replica."""
    from asyncckpt.formats import FORMAT_KEY

    store = _side_store()
    receiver = R.ReplicaReceiver(_cfg(1, store.port), R.ReplicaConfig(peer=0, source=0))
    registry, events = R.ArenaRegistry(), _Events()
    sender = R.ReplicaSender(
        _cfg(0, store.port), R.ReplicaConfig(peer=1, source=1), registry, events
    )
    try:
        job = _job(registry, 1, 2, 7)
        job.extra = {FORMAT_KEY: object()}
        sender.offer(job, [])
        error = events.replicated(1).error
    finally:
        receiver.close()
        sender._close()
    assert error is not None and "registered by the user" in error, error
    assert receiver.steps() == []


def _decode(header: dict, segments: list[bytes] = ()) -> tuple:
    from asyncckpt import jobwire

    return jobwire.decode_replica(framing.Message({"kind": "replica", **header}, list(segments)))


def test_a_header_that_does_not_add_up_is_refused_before_anything_is_allocated():
    from asyncckpt import jobwire

    job, specs, sizes = _prepared_job("dcp", STATE)
    header, segments = jobwire.encode_replica(job, specs, sizes, [])
    header.pop("kind")
    assert _decode(header, segments)[0].step == 12

    def broken(change) -> dict:
        h = __import__("copy").deepcopy(header)
        change(h)
        return h

    bad = [
        broken(lambda h: h["job"]["specs"][0].update(offset=sizes[0])),  # outside its arena
        broken(lambda h: h["job"]["specs"][0].update(nbytes=1)),  # not its shape's size
        broken(lambda h: h["job"]["specs"][0].update(arena=1)),  # an arena not sent
        broken(lambda h: h["job"]["specs"][0].update(dtype="object")),
        broken(lambda h: h["job"].update(step=True)),
        broken(lambda h: h["job"].update(step=-1)),
        broken(lambda h: h.update(sizes=[-5])),
        broken(lambda h: h["job"]["objects"].update(step=7)),  # no such segment
        broken(lambda h: h["job"]["extra"].update(skeleton=0)),  # (a pickle never travels)
        broken(lambda h: h["job"].update(tier="disk")),
        broken(lambda h: h["job"]["paths"].update(x=[["q", 1]])),
    ]
    for h in bad:
        with pytest.raises(framing.ProtocolError):
            _decode(h, segments)
    with pytest.raises(framing.ProtocolError, match="does not name"):
        _decode(header, [*segments, b"extra"])


def test_a_header_longer_than_the_limit_is_refused_before_it_is_read():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", framing.MAX_HEADER_BYTES + 1))
        with pytest.raises(framing.ProtocolError, match="over"):
            framing.recv_msg(b)
        a.sendall(framing.encode_header({"kind": "x", "segments": [1 << 40]}))
        asked = []
        with pytest.raises(MemoryError):
            framing.recv_msg(b, segment_room=lambda n: asked.append(n) or _no_room(n))
        assert asked == [1 << 40]
        a.sendall(framing.encode_header({"kind": "x", "segments": [3]}) + b"abc")
        with pytest.raises(framing.ProtocolError, match="no segments"):
            framing.recv_msg(b)  # (a message of a kind that carries none)


def _no_room(n: int) -> None:
    raise MemoryError(f"no room for {n} bytes")


# ------------------------------------------------------------------ the node-local server


def _replica_on_disk(root: Path, node: int, step: int, files: dict[str, bytes]) -> Path:
    """A committed replica directory under ``root`` (as a stand-in's node commit leaves it)."""
    import json

    where = LR.replica_dir(root, "global_step", node, step)
    where.mkdir(parents=True)
    entries = {}
    for rel, data in files.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_bytes(data)
        entries[rel] = {"size": len(data), "crc32c": checksum(data)}
    (where / L.MANIFEST).write_text(json.dumps({"step": step, "files": entries}))
    return where


def _server(root: Path) -> LR.ReplicaServer:
    return LR.ReplicaServer(root, "global_step")


def test_a_strangers_pickle_to_the_node_local_server_runs_nothing(tmp_path):
    ran = tmp_path / "ran"
    _replica_on_disk(tmp_path / "node0", 1, 3, {"a.distcp": b"shard bytes"})
    server = _server(tmp_path / "node0")
    try:
        address = ("127.0.0.1", server.port)
        _talk(address, _pickled(_Marker(ran)))
        _talk(address, pickle.dumps(_Marker(ran)))
    finally:
        server.close()
    assert not ran.exists()
    assert server.served == 0


# ------------------------------------------------------------------ names from a peer


class _EvilServer:
    """A peer that knows the run's secret (a bug, or a member gone wrong) and sends a manifest
    naming files outside the fetch's destination, then their bytes."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.getsockname()[:2]

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        with sock:
            try:
                framing.handshake_server(sock, SECRET, LR.FETCH_SERVICE)
                framing.recv_msg(sock)
                entries = {
                    rel: {"size": len(d), "crc32c": checksum(d)} for rel, d in self.files.items()
                }
                framing.send_msg(
                    sock, {"kind": "manifest", "manifest": {"step": 3, "files": entries}}
                )
                for data in self.files.values():
                    sock.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self.thread.join(30)
        self.listener.close()


# ------------------------------------------------------------------ what is bound


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening_on(port: int) -> list[str]:
    return [
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]


def _opener() -> tuple[bytes, bytes]:
    nonce = os.urandom(framing.NONCE_BYTES)
    return nonce, framing.MAGIC + nonce
