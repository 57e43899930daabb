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
import logging
import os
import pickle
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from asyncckpt.cluster import framing
from asyncckpt.cluster import local_recovery as LR
from asyncckpt.cluster.dist import DistConfig
from asyncckpt.core import layout as L
from asyncckpt.core import messages as M
from asyncckpt.memory import replication as R
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.manifest import checksum
from asyncckpt.worker.loop import SaveJob

SECRET = secrets.token_hex(32)
WILDCARDS = ("0.0.0.0", "::")


def _cfg(rank: int, port: int, secret: str = SECRET) -> DistConfig:
    return DistConfig(rank, 2, 0, "127.0.0.1", port, "tok", 30.0, secret=secret)


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


def _talk(address: tuple[str, int], data: bytes, seen: list | None = None) -> bytes:
    """Send ``data`` as a stranger would, then read until the listener closes the connection;
    returns what it sent back (``seen``: the stranger's port is added)."""
    got = bytearray()
    with socket.create_connection(address, timeout=30) as sock:
        if seen is not None:
            seen.append(sock.getsockname()[1])
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


def _guess_the_secret(
    address: tuple[str, int], then: bytes = b"", seen: list | None = None
) -> bytes:
    """A stranger that speaks the handshake without the secret: its opener, then a proof made
    with a key of its own, then ``then``; returns what the listener sent back."""
    got = bytearray()
    with socket.create_connection(address, timeout=30) as sock:
        if seen is not None:
            seen.append(sock.getsockname()[1])
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


def test_a_stranger_without_the_secret_is_refused_before_its_header_is_read(
    run, monkeypatch, caplog
):
    """Neither the old hello nor a handshake with a guessed key gets a header read; the
    connection's end is no sign that the source's worker is gone (that would make the holder
    stand in for a live rank)."""
    read = []  # the peers' ports of the connections whose header the receiver read
    real = framing.recv_msg

    def reading(sock, **kw):
        read.append(sock.getpeername()[1])
        return real(sock, **kw)

    monkeypatch.setattr(R, "recv_msg", reading, raising=False)
    hello = framing.encode_header({"kind": "hello", "rank": 0})
    strangers: list[int] = []
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        _talk(run.address, _pickled(("hello", 0)), strangers)
        _talk(run.address, hello, strangers)
        _guess_the_secret(run.address, hello, strangers)
        _talk(run.address, b"", strangers)  # connect and close
    assert strangers and not set(strangers) & set(read)
    assert not run.receiver.gone.is_set()
    assert run.holds_what_it_held()
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    for port in strangers:  # each logged: its address, and why
        assert any(f"{port}" in m and "did not prove" in m for m in refused), (port, refused)


def _crafted_replica(step: int, keep: list[int]) -> list[bytes]:
    """Today's messages of a replica of a stranger's making, checksums matching."""
    data = b"\x01" * 4096
    job = SaveJob(step, step, [1], [], {"evil": b"x"}, {}, {}, tier="memory")
    return [
        _pickled(("hello", 0)),
        _pickled(("replica", job, [len(data)], keep)),
        data + R._END + _pickled(("crcs", [checksum(data)])),
    ]


def test_a_crafted_replica_from_a_stranger_is_never_held(run):
    with socket.create_connection(run.address, timeout=30) as sock:
        first, header, rest = _crafted_replica(9, keep=[])
        with_errors_ignored(sock.sendall, first + header)
        sock.settimeout(5)
        try:
            sock.recv(1 << 16)  # "ready" on main
            sock.sendall(rest)
            sock.recv(1 << 16)  # "held" on main
        except OSError:
            pass  # refused: the connection is closed
    assert run.holds_what_it_held()
    assert not run.receiver.gone.is_set()


def test_a_sender_that_does_not_know_the_secret_gets_nothing_held(run):
    registry, events = R.ArenaRegistry(), _Events()
    stranger = R.ReplicaSender(
        _cfg(0, run.store.port, secret=secrets.token_hex(32)),
        R.ReplicaConfig(peer=1, source=1),
        registry,
        events,
    )
    try:
        stranger.offer(_job(registry, 5, 9, 1), [])
        error = events.replicated(5).error
    finally:
        stranger._close()
    assert error is not None and "prove" in error, error
    assert run.holds_what_it_held()
    assert not run.receiver.gone.is_set()


def test_the_sender_sends_nothing_to_a_receiver_that_cannot_prove_it_belongs_to_the_run():
    """The address read from the side store could be anybody's: the sender checks the
    receiver's proof before its header (the state's objects) goes out."""
    store = _side_store()
    impostor = socket.create_server(("127.0.0.1", 0))
    store.set("asyncckpt/tok/replica/addr/1", f"127.0.0.1:{impostor.getsockname()[1]}")
    got = bytearray()

    def answer() -> None:
        sock, _ = impostor.accept()
        with sock:
            sock.settimeout(30)
            try:
                got.extend(sock.recv(1 << 16))
                # as a receiver would answer, without the secret
                sock.sendall(getattr(framing, "MAGIC", b"") + os.urandom(64))
                while chunk := sock.recv(1 << 16):
                    got.extend(chunk)
            except OSError:
                pass

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    registry, events = R.ArenaRegistry(), _Events()
    sender = R.ReplicaSender(
        _cfg(0, store.port), R.ReplicaConfig(peer=1, source=1), registry, events
    )
    try:
        sender.offer(_job(registry, 1, 2, 7), [])
        error = events.replicated(1).error
    finally:
        sender._close()
        thread.join(30)
        impostor.close()
    assert error is not None and "prove" in error, error
    assert b"run's own state" not in got
    assert len(got) == len(framing.MAGIC) + framing.NONCE_BYTES  # its opener, then nothing


# ------------------------------------------------------------------ the replica's header


def _prepared_job(fmt: str, state: dict, **kw) -> tuple[SaveJob, list, list[int]]:
    from asyncckpt.formats.staged import prepare
    from asyncckpt.staging.arenas import plan_arenas

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
    from asyncckpt.memory import jobwire

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
    from asyncckpt.formats import FORMAT_KEY
    from asyncckpt.formats.components import Component
    from asyncckpt.formats.components import prepare as components
    from asyncckpt.memory import jobwire

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
    from asyncckpt.memory import jobwire

    return jobwire.decode_replica(framing.Message({"kind": "replica", **header}, list(segments)))


def test_a_header_that_does_not_add_up_is_refused_before_anything_is_allocated():
    from asyncckpt.memory import jobwire

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
        head = framing.encode_header({"kind": "x", "segments": [1 << 20, 5]})
        rest = b"\0" * ((1 << 20) + 5) + framing.encode_header({"kind": "next"})
        threading.Thread(target=a.sendall, args=(head + rest,), daemon=True).start()
        asked = []
        with pytest.raises(MemoryError):
            framing.recv_msg(b, segment_room=lambda n: asked.append(n) or _no_room(n))
        assert asked == [(1 << 20) + 5]
        assert framing.recv_msg(b).kind == "next"  # (read past: the connection stays in step)
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
    return LR.ReplicaServer(root, "global_step", host="127.0.0.1", secret=SECRET)


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


def test_a_stranger_gets_no_replica_from_the_node_local_server(tmp_path):
    _replica_on_disk(tmp_path / "node0", 1, 3, {"a.distcp": b"shard bytes"})
    server = _server(tmp_path / "node0")
    address = ("127.0.0.1", server.port)
    ask = framing.encode_header({"kind": "get", "node": 1, "step": 3})
    try:
        old = _talk(address, _pickled(("get", 1, 3)))
        guessed = _guess_the_secret(address, ask)
        into = LocalStore(tmp_path).stage("fetched", "t")
        with pytest.raises(ConnectionError, match="prove"):
            LR.fetch_replica(address, 1, 3, into, secret=secrets.token_hex(32))
    finally:
        server.close()
    assert old == b""  # not even the handshake: the opener was not ours
    assert b"shard bytes" not in guessed and b"manifest" not in guessed
    assert server.served == 0
    assert list(into.iterdir()) == []


def test_the_fetch_refuses_a_server_that_cannot_prove_it_belongs_to_the_run(tmp_path):
    impostor = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        sock, _ = impostor.accept()
        with sock:
            sock.recv(1 << 16)
            sock.sendall(framing.MAGIC + os.urandom(64))
            sock.recv(1 << 16)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    into = LocalStore(tmp_path).stage("fetched", "t")
    try:
        with pytest.raises(ConnectionError, match="prove"):
            LR.fetch_replica(impostor.getsockname()[:2], 1, 3, into, secret=SECRET)
    finally:
        thread.join(30)
        impostor.close()
    assert list(into.iterdir()) == []


def test_the_server_serves_only_the_committed_replicas_it_holds_and_their_files(tmp_path):
    """A request for anything but a (node, step) the root holds committed is refused, and a
    manifest on the holder's disk naming a file outside its directory is never served."""
    root = tmp_path / "node0"
    outside = tmp_path / "private.txt"
    outside.write_bytes(b"not a replica")
    where = _replica_on_disk(root, 1, 3, {"a.distcp": b"shard bytes"})
    import json

    manifest = json.loads((where / L.MANIFEST).read_text())
    manifest["files"]["../../../../private.txt"] = {
        "size": 13,
        "crc32c": checksum(b"not a replica"),
    }
    (where / L.MANIFEST).write_text(json.dumps(manifest))
    (root / LR.REPLICAS_DIR / "node1" / "global_step_4").mkdir()  # no manifest: not committed
    server = _server(root)
    address = ("127.0.0.1", server.port)
    try:
        for node, step in ((1, 3), (1, 4), (-1, 3), (2, 3)):
            into = LocalStore(tmp_path).stage("fetched", f"{node}-{step}")
            with pytest.raises(OSError):
                LR.fetch_replica(address, node, step, into, secret=SECRET)
            assert list(into.iterdir()) == []
    finally:
        server.close()
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


@pytest.mark.parametrize(
    "bad", ["../x", "ABSOLUTE", "../global_step_1/model.distcp", "a/../../x", "a/./b", "", "a\x00b"]
)
def test_a_name_from_the_peer_outside_the_destination_fails_the_fetch_and_writes_nothing(
    tmp_path, bad
):
    root = tmp_path / "node1"
    committed = root / "global_step_1" / "model.distcp"
    committed.parent.mkdir(parents=True)
    committed.write_bytes(b"committed bytes")
    absolute = tmp_path / "absolute.bin"
    name = str(absolute) if bad == "ABSOLUTE" else bad
    before = sorted(p for p in tmp_path.rglob("*"))
    into = LocalStore(root).stage(L.dir_name("global_step", 3), "fetch")
    evil = _EvilServer({"good.distcp": b"fine", name: b"evil"})
    try:
        with pytest.raises(OSError, match="name"):
            LR.fetch_replica(evil.address, 1, 3, into, secret=SECRET)
    finally:
        evil.close()
    assert committed.read_bytes() == b"committed bytes"
    assert not absolute.exists() and not (root / "x").exists() and not (tmp_path / "x").exists()
    assert list(into.iterdir()) == []  # what the fetch wrote is gone (here: nothing was)
    assert sorted(p for p in tmp_path.rglob("*")) == sorted([*before, into])


def test_a_file_the_peer_names_twice_or_that_exists_is_never_truncated(tmp_path):
    """A name already there in the destination (here: written by the fetch itself, as ``a``
    and ``./a`` would be) is never opened for writing again: the fetch fails and removes what
    it wrote."""
    into = LocalStore(tmp_path).stage("fetched", "t")
    (into / "kept").write_bytes(b"the caller's")
    evil = _EvilServer({"new.distcp": b"new", "kept": b"evil"})
    try:
        with pytest.raises(OSError):
            LR.fetch_replica(evil.address, 1, 3, into, secret=SECRET)
    finally:
        evil.close()
    assert (into / "kept").read_bytes() == b"the caller's"
    assert sorted(p.name for p in into.iterdir()) == ["kept"]


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


def test_no_listener_is_bound_to_every_interface(tmp_path):
    from asyncckpt.cluster.dist import Rendezvous
    from asyncckpt.cluster.recovery_store import BackupStore

    run = _Run()
    server = _server(tmp_path)
    rank0 = _side_store()
    cfg = DistConfig(2, 4, 0, "127.0.0.1", rank0.port, "tok", 10.0, ranks_per_node=2, secret=SECRET)
    backup = BackupStore(cfg, "127.0.0.1")  # rank 2 holds rank 0's replica: it serves one
    rendezvous = Rendezvous()
    try:
        rendezvous.setup(0, 1, 0, store=("127.0.0.1", _free_port()), timeout=10)
        assert backup.ready.wait(30) and backup.server is not None
        ports = {
            "replica receiver": run.receiver.listener.getsockname()[1],
            "node-local server": server.port,
            "second side store": backup.server.port,
            "side store": rendezvous.listener.getsockname()[1],
        }
        bound = {what: _listening_on(p) for what, p in ports.items()}
    finally:
        run.close()
        server.close()
        rendezvous.close()
    assert all(ips for ips in bound.values()), bound
    assert not any(ip in WILDCARDS for ips in bound.values() for ip in ips), bound


def test_an_address_that_is_not_this_machines_says_how_to_listen(monkeypatch):
    """Behind NAT the published address is not one of the machine's own: the listener says
    so and how to bind another (``ASYNCCKPT_BIND_HOST``), and binds that one when it is set."""
    monkeypatch.delenv(framing.BIND_ENV, raising=False)
    with pytest.raises(OSError, match=framing.BIND_ENV):
        framing.listen("192.0.2.1")  # (TEST-NET-1: nobody's)
    monkeypatch.setenv(framing.BIND_ENV, "127.0.0.1")
    with framing.listen("192.0.2.1") as sock:
        assert sock.getsockname()[0] == "127.0.0.1"


def test_a_machine_name_that_resolves_to_loopback_is_said(monkeypatch, caplog):
    """Debian's /etc/hosts maps the machine's name to 127.0.1.1: bound there, other machines
    never reach the listener. Said once; an address or ``localhost`` is meant as it is."""
    real = socket.getaddrinfo

    def resolve(host, *a, **k):
        return real("127.0.0.1" if host == "node0.example" else host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(framing, "_warned", set())
    monkeypatch.delenv(framing.BIND_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        for host in ("127.0.0.1", "localhost", "node0.example", "node0.example"):
            framing.listen(host).close()
    said = [
        r.getMessage() for r in caplog.records if "reachable from this machine" in r.getMessage()
    ]
    assert len(said) == 1 and said[0].startswith("node0.example resolves to 127.0.0.1"), said


def test_the_secret_is_shared_by_the_rendezvous_and_never_shown(monkeypatch, caplog):
    """Rank 0's trainer makes it and publishes it beside the side store's address; every rank
    reads it from there. Never in a repr or a log line."""
    from asyncckpt.cluster import dist as _dist

    port = _free_port()
    zero, one = _dist.Rendezvous(), _dist.Rendezvous()
    with caplog.at_level(logging.DEBUG, logger="asyncckpt"):
        mine = zero.setup(0, 2, 0, store=("127.0.0.1", port), timeout=30)
        starts = vars(_dist)["_engine_starts"]  # (the engines this process started)
        monkeypatch.setattr(_dist, "_engine_starts", starts - 1)  # rank 1's turn, here too
        theirs = one.setup(1, 2, 1, store=("127.0.0.1", port), timeout=30)
    zero.close()
    assert mine.secret == theirs.secret and len(mine.secret) >= 64
    other = _dist.Rendezvous()
    assert other.setup(0, 1, 0, store=("127.0.0.1", _free_port()), timeout=30).secret != mine.secret
    other.close()  # (another run: another secret)
    assert mine.secret not in repr(mine) and mine.secret not in str(theirs)
    assert not any(mine.secret in r.getMessage() for r in caplog.records)


def _opener() -> tuple[bytes, bytes]:
    nonce = os.urandom(framing.NONCE_BYTES)
    return nonce, framing.MAGIC + nonce


def test_the_handshake_proves_the_secret_both_ways_with_one_role_each():
    """Each side's proof covers both nonces, the service and its own role: the server's
    proof sent back as the client's (a reflection) proves nothing, nor does the secret used
    for another service."""
    results: list = []

    def serve(sock: socket.socket, service: str) -> None:
        try:
            framing.handshake_server(sock, SECRET, service)
            results.append("accepted")
        except ConnectionError as e:
            results.append(e)

    def server(service: str = "svc") -> socket.socket:
        a, b = socket.socketpair()
        threading.Thread(target=serve, args=(b, service), daemon=True).start()
        return a

    def outcome() -> object:
        deadline = time.monotonic() + 30
        while not results and time.monotonic() < deadline:
            time.sleep(0.01)
        return results.pop()

    with server() as sock:  # the run's own client
        framing.handshake_client(sock, SECRET, "svc")
    assert outcome() == "accepted"

    with server() as sock:  # the server's own proof reflected
        _, opener = _opener()
        sock.sendall(opener)
        reply = framing.recv_exact(
            sock, len(framing.MAGIC) + framing.NONCE_BYTES + framing.MAC_BYTES
        )
        sock.sendall(reply[-framing.MAC_BYTES :])
    assert isinstance(outcome(), ConnectionError)

    with server("another service") as sock:  # the right secret, for another service
        with pytest.raises(ConnectionError, match="prove"):
            framing.handshake_client(sock, SECRET, "svc")
    assert isinstance(outcome(), ConnectionError)

    with server() as sock:  # no secret at all
        with pytest.raises(ConnectionError, match="prove"):
            framing.handshake_client(sock, secrets.token_hex(32), "svc")
    assert isinstance(outcome(), ConnectionError)
