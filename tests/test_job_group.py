"""The per-save job group connects lazily: forming it is no rendezvous with every other rank.

Eagerly, gloo's group creation reads every other rank's address from the side store and
connects to each (N(N-1) reads and N(N-1)/2 connections per save over N ranks, the part of a
commit that grew faster than linear with the ranks); lazily, a pair connects on its first
message. Here rank 0 of a world of 2 forms its group alone: lazily it gets the group at once,
eagerly it waits for rank 1 until the timeout.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from asyncckpt import dist as _dist


@pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 7),
    reason="gloo's lazy connection is in torch >= 2.7",
)
def test_job_group_forms_without_waiting_for_every_rank():
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, use_libuv=True)
    cfg = _dist.DistConfig(0, 2, 0, "127.0.0.1", server.port, "tok", timeout=5.0)
    before = os.environ.get("TORCH_GLOO_LAZY_INIT")
    with _dist.job_group(cfg, "1.0") as pg:
        assert dist.get_world_size(pg) == 2 and dist.get_rank(pg) == 0
        # the switch is set for the group's creation only, a user's own groups stay eager
        assert os.environ.get("TORCH_GLOO_LAZY_INIT") == before
    assert not dist.is_initialized()


def test_job_groups_reuse_one_connection_to_the_side_store(monkeypatch):
    """Every save's group used to open a new connection to the side store: N connections per
    save at the one store (on this machine 1 in ~10 of 32 simultaneous reconnections took 5 s,
    and a 32-rank commit took 6 s instead of 0.2 s). A worker now keeps one; one that stops
    answering is replaced."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, use_libuv=True)
    cfg = _dist.DistConfig(0, 1, 0, "127.0.0.1", server.port, "tok-reuse", timeout=5.0)
    opened = []
    real = dist.TCPStore

    def counting(*args, **kwargs):
        opened.append(args[:2])
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", counting)
    monkeypatch.setattr(_dist, "_job_client", {}, raising=False)
    for step in range(3):
        with _dist.job_group(cfg, f"{step}.0") as pg:
            assert dist.get_world_size(pg) == 1
    assert len(opened) == 1

    class Gone:
        def num_keys(self):
            raise RuntimeError("Connection reset by peer")

    _dist._job_client[("127.0.0.1", server.port)] = Gone()
    with _dist.job_group(cfg, "3.0"):
        pass
    assert len(opened) == 2  # (a fresh connection in place of the dead one)
    with pytest.raises(RuntimeError), _dist.job_group(cfg, "4.0"):
        raise RuntimeError("a peer died")
    assert _dist._job_client == {}  # a broken group's connection is not reused
