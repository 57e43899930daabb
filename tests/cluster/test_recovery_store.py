"""Node 0's loss on node-local roots (recovery_store.py): the second side store the holder of
rank 0's replica serves, and the switch to it at the trainers' death when rank 0's store is
gone. In one process; the nodes killed for real: test_node_local_replicas.py."""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from asyncckpt.cluster.dist import DistConfig, side_store
from asyncckpt.cluster.recovery_store import BackupStore
from asyncckpt.memory import replication as R


@dataclass(frozen=True)
class _Config:  # the fields of WorkerConfig that recovering reads and replaces
    dist: DistConfig
    replication: Any = "replicas=1"


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on return: nobody listens there


def _rank0_store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10))


def _cfg(rank: int, port: int, timeout: float = 10.0) -> DistConfig:
    return DistConfig(rank, 4, rank % 2, "127.0.0.1", port, "tok", timeout, ranks_per_node=2)


def test_the_recovery_moves_to_the_second_store_only_when_rank_0s_is_gone():
    rank0 = _rank0_store()
    holder = BackupStore(_cfg(2, rank0.port), "127.0.0.1")  # rank 2 holds rank 0's replica
    other = BackupStore(_cfg(3, rank0.port), "127.0.0.1")
    assert holder.ready.wait(10) and other.ready.wait(10)
    assert holder.server is not None and other.server is None  # served by the holder only
    assert other.address == holder.address == ("127.0.0.1", holder.server.port)

    alive = _Config(_cfg(3, rank0.port))
    assert R.recovering(alive, SimpleNamespace(backup=other)) is alive  # rank 0's answers

    gone = _Config(_cfg(3, _dead_port()))  # node 0 lost: its worker's store with it
    moved = R.recovering(gone, SimpleNamespace(backup=other))
    assert (moved.dist.host, moved.dist.port) == holder.address
    assert moved.dist.rank == 3 and moved.dist.token == "tok"
    side_store(moved.dist).set("said-by-3", b"x")  # the ranks meet there
    assert side_store(R.recovering(gone, SimpleNamespace(backup=holder)).dist).get("said-by-3")


def test_without_a_known_second_store_the_config_is_unchanged():
    """The holder never published one (its worker never started): nothing to switch to; the
    recovery then fails to agree, as before, and says why."""
    rank0 = _rank0_store()
    lone = BackupStore(_cfg(3, rank0.port, timeout=1.0), "127.0.0.1")
    assert lone.ready.wait(10) and lone.address is None
    gone = _Config(_cfg(3, _dead_port()))
    assert R.recovering(gone, SimpleNamespace(backup=lone)) is gone
