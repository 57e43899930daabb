"""Issue 33, replication (``MemoryTier(replicas=1)``): the pure decisions, the option's checks,
the handle's answer, and the transport between two workers' halves in one process (a replica is
held whole or not at all). The nodes killed for real: test_replication_nodes.py."""

from __future__ import annotations

import datetime
import itertools
import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt import CheckpointEngine, Distributed, MemoryTier, NotReplicated
from asyncckpt.cluster.dist import DistConfig
from asyncckpt.core import messages as M
from asyncckpt.memory import replication as R
from asyncckpt.stats import SaveStats
from asyncckpt.trainer.jobs import SaveHandle
from asyncckpt.worker.loop import SaveJob

STEPS = (1, 2, 3)


def _subsets() -> list[frozenset[int]]:
    return [frozenset(c) for n in range(len(STEPS) + 1) for c in itertools.combinations(STEPS, n)]


def _check_choice(own: dict, replicas: dict, world: int) -> None:
    step = R.which_step_to_persist(own, replicas, world)
    voices = [own.get(r, replicas.get(r)) for r in range(world)]
    if any(v is None for v in voices):
        assert step is None  # a rank neither alive nor replicated: nothing is written
        return
    common = set.intersection(*(set(v) for v in voices))
    if step is None:
        assert not common
    else:  # held by every rank's voice, and none newer is
        assert all(step in v for v in voices)
        assert step == max(common)


def test_which_step_to_persist_exhaustively():
    """Two ranks: each alive (its own steps), dead with a replica, or dead without one."""
    choices = [("own", s) for s in _subsets()] + [("replica", s) for s in _subsets()]
    choices.append(("lost", None))
    for a, b in itertools.product(choices, repeat=2):
        own, replicas = {}, {}
        for r, (kind, steps) in enumerate((a, b)):
            if kind == "own":
                own[r] = steps
            elif kind == "replica":
                replicas[r] = steps
        _check_choice(own, replicas, 2)


@settings(max_examples=300, deadline=None)
@given(
    world=st.integers(1, 6),
    data=st.data(),
)
def test_which_step_to_persist_any_world(world, data):
    own, replicas = {}, {}
    for r in range(world):
        kind = data.draw(st.sampled_from(["own", "replica", "both", "lost"]))
        if kind in ("own", "both"):
            own[r] = data.draw(st.frozensets(st.sampled_from(STEPS)))
        if kind in ("replica", "both"):
            replicas[r] = data.draw(st.frozensets(st.sampled_from(STEPS)))
    _check_choice(own, replicas, world)


def test_a_ranks_own_worker_wins_over_its_replica():
    # Rank 1's worker holds 3; a stale replica of it holds only 2: its own word counts.
    assert R.which_step_to_persist({0: {2, 3}, 1: {2, 3}}, {1: {2}}, 2) == 3
    assert R.which_step_to_persist({0: {2, 3}}, {1: {2}}, 2) == 2  # its node is gone
    assert R.which_step_to_persist({0: {2, 3}}, {}, 2) is None  # nobody holds rank 1


@pytest.mark.parametrize("nodes,per", [(2, 1), (2, 2), (3, 2), (4, 3)])
def test_peer_and_source_ranks(nodes, per):
    for rank in range(nodes * per):
        node = rank // per
        peer = R.peer_rank(rank, node, per, nodes)
        assert peer // per == (node + 1) % nodes and peer % per == rank % per
        assert R.source_rank(peer, peer // per, per, nodes) == rank


def test_replicas_option_is_checked():
    assert MemoryTier(replicas=1).replicas == 1
    for bad in (2, -1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="replicas must be 0 or 1"):
            MemoryTier(replicas=bad)


@pytest.mark.parametrize(
    "distributed,match",
    [
        (Distributed(rank=0, world_size=2, node_rank=0, ranks_per_node=2), "runs on one node"),
        (Distributed(rank=1, world_size=2, local_rank=0), "node layout is unknown"),
        (
            Distributed(rank=0, world_size=2, node_rank=0, ranks_per_node=2, storage="local"),
            "runs on one node",
        ),
    ],
)
def test_replicas_refused_without_another_node(tmp_path, monkeypatch, distributed, match):
    for var in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=match):
        CheckpointEngine(tmp_path, distributed=distributed, memory=MemoryTier(replicas=1))


@pytest.mark.parametrize("storage", ["shared", "local"])
def test_replicas_one_engine_on_two_nodes_is_made(tmp_path, monkeypatch, storage):
    for var in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    engine = CheckpointEngine(
        tmp_path,
        distributed=Distributed(
            rank=3, world_size=4, local_rank=1, node_rank=1, ranks_per_node=2, storage=storage
        ),
        memory=MemoryTier(replicas=1),
    )
    assert (engine.node_rank, engine.nodes) == (1, 2)


def test_the_handle_says_whether_its_replica_is_held():
    handle = SaveHandle(5, SaveStats(step=5))
    with pytest.raises(NotReplicated, match="not a replicated save"):
        handle.replicated_sync(0)
    handle._replica = threading.Event()
    with pytest.raises(TimeoutError):
        handle.replicated_sync(0.01)
    assert not handle.is_replicated()
    handle._replica_done(None)
    handle.replicated_sync(0)
    assert handle.is_replicated()
    failed = SaveHandle(6, SaveStats(step=6))
    failed._replica = threading.Event()
    failed._replica_done("superseded by step 7 before it was sent")
    with pytest.raises(NotReplicated, match="superseded by step 7"):
        failed.replicated_sync(0)


# ------------------------------------------------------------------ the transport, in-process


class _Events:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.got: list = []

    def send(self, msg) -> None:
        with self.cond:
            self.got.append(msg)
            self.cond.notify_all()

    def replicated(self, job_id: int, timeout: float = 30.0) -> M.Replicated:
        with self.cond:
            assert self.cond.wait_for(
                lambda: any(isinstance(m, M.Replicated) and m.job_id == job_id for m in self.got),
                timeout,
            ), self.got
            return next(m for m in self.got if isinstance(m, M.Replicated) and m.job_id == job_id)


@pytest.fixture
def pair():
    """Rank 0's sender and rank 1's receiver, over a side store of their own."""
    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False
    )
    secret = "5e" * 32  # the run's: every replica connection proves it (framing.py)
    cfg0 = DistConfig(0, 2, 0, "127.0.0.1", server.port, "tok", 30.0, secret=secret)
    cfg1 = DistConfig(1, 2, 0, "127.0.0.1", server.port, "tok", 30.0, secret=secret)
    receiver = R.ReplicaReceiver(cfg1, R.ReplicaConfig(peer=0, source=0))
    registry, events = R.ArenaRegistry(), _Events()
    sender = R.ReplicaSender(cfg0, R.ReplicaConfig(peer=1, source=1), registry, events)
    yield registry, sender, receiver, events
    receiver.close()
    sender._close()


def _job(registry, job_id: int, step: int, fill: int, nbytes: int = 1 << 20, faults=None):
    arena = torch.full((nbytes,), fill, dtype=torch.uint8)
    registry.note(M.Arena(100 + job_id, arena))
    job = SaveJob(
        job_id=job_id,
        step=step,
        arena_ids=[100 + job_id],
        specs=[],
        objects={"step": b"x"},
        paths={},
        metrics={},
        faults=faults or {},
        tier="memory",
    )
    return job, arena


def _held_bytes(receiver, step: int) -> torch.Tensor:
    replica = receiver.held[step]
    return next(iter(replica.arenas.values())).tensor


def test_a_replica_is_held_whole_and_mirrors_what_the_sender_keeps(pair):
    registry, sender, receiver, events = pair
    job2, arena2 = _job(registry, 1, 2, 7)
    sender.offer(job2, [])
    assert events.replicated(1).error is None
    job3, arena3 = _job(registry, 2, 3, 9)
    sender.offer(job3, [2])
    assert events.replicated(2).error is None
    assert receiver.steps() == [2, 3]
    assert torch.equal(_held_bytes(receiver, 2), arena2)
    assert torch.equal(_held_bytes(receiver, 3), arena3)
    assert receiver.held[3].job.objects == {"step": b"x"}
    job4, _ = _job(registry, 3, 4, 11)
    sender.offer(job4, [3])  # the sender let go of step 2
    assert events.replicated(3).error is None
    assert receiver.steps() == [3, 4]


def test_a_transfer_cut_off_leaves_the_previous_replica(pair):
    """The slot is released mid-transfer (as the trainer reclaiming it, or the sender dying):
    the receiver keeps what it held, never a torn replica."""
    registry, sender, receiver, events = pair
    job2, arena2 = _job(registry, 1, 2, 7)
    sender.offer(job2, [])
    assert events.replicated(1).error is None
    slow = {"mid_replication": ("delay", 0, 1.0, "f1")}
    job3, _ = _job(registry, 2, 3, 9, faults=slow)
    sender.offer(job3, [2])
    time.sleep(0.5)  # the header is out, the bytes wait
    sender.release(2)
    assert events.replicated(2).error is not None
    time.sleep(0.3)
    assert receiver.steps() == [2]
    assert torch.equal(_held_bytes(receiver, 2), arena2)
    job4, arena4 = _job(registry, 3, 4, 11)  # the next one reconnects
    sender.offer(job4, [2])
    assert events.replicated(3).error is None
    assert receiver.steps() == [2, 4]
    assert torch.equal(_held_bytes(receiver, 4), arena4)


def test_a_slot_released_before_the_receiver_is_ready_is_never_read(pair, monkeypatch):
    """Job 1's slot is released while its header waits for the receiver's "ready", then
    reused by the trainer; another job's release came meanwhile. The sender remembered one
    released job only, read the reused slot and the receiver held other bytes as step 2."""
    from asyncckpt.staging import arenas as staging

    registry, sender, receiver, events = pair
    real = staging.check_memory

    def slow(nbytes):  # a receiver slow to say "ready" (allocating, CPU-starved)
        time.sleep(1.5)
        return real(nbytes)

    monkeypatch.setattr(staging, "check_memory", slow)
    job2, arena2 = _job(registry, 1, 2, 7)
    sender.offer(job2, [])
    time.sleep(0.3)  # the header is out, waiting for "ready"
    sender.release(1)
    arena2.fill_(99)  # the trainer stages another step into the slot
    sender.release(5)
    assert events.replicated(1).error is not None
    time.sleep(0.3)
    assert 2 not in receiver.steps()


def test_a_receiver_without_room_refuses_and_keeps_what_it_held(pair, monkeypatch):
    from asyncckpt.errors import StagingMemoryError
    from asyncckpt.staging import arenas as staging

    registry, sender, receiver, events = pair
    job2, _ = _job(registry, 1, 2, 7)
    sender.offer(job2, [])
    assert events.replicated(1).error is None

    def full(nbytes):
        raise StagingMemoryError("no room")

    monkeypatch.setattr(staging, "check_memory", full)
    job3, _ = _job(registry, 2, 3, 9, nbytes=2 << 20)  # a new size: nothing to reuse
    sender.offer(job3, [2])
    assert "cannot hold it" in events.replicated(2).error
    assert receiver.steps() == [2]


def test_a_replica_damaged_on_the_way_is_refused_and_the_sender_told(pair, monkeypatch):
    """One byte flipped between the sender's memory and the receiver's (the NIC, the wire:
    TCP's 16-bit checksum misses some): the receiver held it, and a stand-in would have
    committed the flipped byte with a manifest made from it. Now the sender's checksums of
    what it sent are checked against what arrived: refused, the sender's handle says so, what
    was held before stays, and the next replica goes through."""
    registry, sender, receiver, events = pair
    job2, arena2 = _job(registry, 1, 2, 7)
    sender.offer(job2, [])
    assert events.replicated(1).error is None
    real = R.recv_into
    flips = [1]

    def flipping(sock, view):
        real(sock, view)
        if flips and len(view) > 1000:
            flips.pop()
            view[len(view) // 2] ^= 0x10

    monkeypatch.setattr(R, "recv_into", flipping)
    job3, _ = _job(registry, 2, 3, 9)
    sender.offer(job3, [2])
    error = events.replicated(2).error
    assert error is not None and "received it damaged" in error, error
    assert not flips  # the flip happened
    assert receiver.steps() == [2]
    assert torch.equal(_held_bytes(receiver, 2), arena2)
    job4, arena4 = _job(registry, 3, 4, 11)
    sender.offer(job4, [2])
    assert events.replicated(3).error is None
    assert receiver.steps() == [2, 4]
    assert torch.equal(_held_bytes(receiver, 4), arena4)


def test_a_stand_in_is_a_plain_process_mapping_the_replicas_memory(monkeypatch):
    """The stand-in (replication.spawn_stand_in) is a subprocess given the replica buffers by
    descriptor: it reads the bytes held, and what it writes is the holder's memory."""
    from pathlib import Path

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # tests/stand_in_probe.py
    buffers = {7: R.SharedBuffer(1 << 20), 8: R.SharedBuffer(3), 9: R.SharedBuffer(0)}
    buffers[7].tensor.fill_(2)
    buffers[8].tensor.fill_(1)
    expect = {7: 2 << 20, 8: 3, 9: 0}
    proc = R.spawn_stand_in("stand_in_probe", {"expect": expect}, ["job"], buffers)
    assert proc.wait(60) == 0
    assert [int(b.tensor.sum()) for b in buffers.values()] == [5 << 20, 15, 0]
