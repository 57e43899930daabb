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
