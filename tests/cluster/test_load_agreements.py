"""The ranks' agreements at load cost each rank a constant number of side-store requests.

Before, a hot resume's vote and ``storage="local"``'s step agreement had every rank write
its word under a key of its own and every rank read all N words: N^2 requests per load at
the one store (10^8 at 10,000 ranks), and N keys kept. Ranks are threads here, over one
in-process store.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from asyncckpt.cluster import dist as _dist
from asyncckpt.memory.hot_resume import HotResume
from asyncckpt.trainer.supervisor import wait_for_worker

WORLD = 8


class Counting:
    """One rank's view of the shared store, counting its requests."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return method(*args, **kwargs)

        return counted


def _vote(words: list[bool], tmp_path: Path) -> tuple[list[bool], list[int], int]:
    shared = dist.HashStore()
    cfg = _dist.DistConfig(0, WORLD, 0, "127.0.0.1", 1, "tok", timeout=60.0)
    said: list[bool] = [False] * WORLD
    views = [Counting(shared) for _ in range(WORLD)]

    def rank(r: int) -> None:
        hot = HotResume(tmp_path, r, WORLD, wait_for_worker=wait_for_worker)
        hot.vote_cfg, hot.loads, hot.store = cfg, 1, views[r]
        said[r] = hot.vote(words[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return said, [v.requests for v in views], shared.num_keys()


@pytest.mark.parametrize("no_from", [None, 0, 5])
def test_the_vote_agrees_and_costs_each_rank_a_constant(tmp_path, no_from):
    words = [r != no_from for r in range(WORLD)]
    said, requests, _ = _vote(words, tmp_path)
    assert said == [no_from is None] * WORLD
    # rank 0 also polls the "heard" counter until every rank has its answer: leave it out
    assert max(requests[1:]) <= 6, requests  # before: WORLD + 3 per rank voting yes


def test_a_unanimous_vote_leaves_no_key(tmp_path):
    said, _, keys = _vote([True] * WORLD, tmp_path)
    assert all(said) and keys == 0  # before: WORLD + 1 keys per load, kept


def test_the_load_step_agreement_reads_every_list_on_rank_0_only(tmp_path, monkeypatch):
    """``storage="local"``'s agreement at load on the step every rank loads: every rank read
    every rank's list of steps (N^2 requests per load, N keys kept); now rank 0 reads them
    and publishes the choice."""
    from asyncckpt.trainer.local_load import StepAgreement

    shared = dist.HashStore()
    views = [Counting(shared) for _ in range(WORLD)]
    monkeypatch.setattr(_dist, "side_store", lambda cfg: views[cfg.rank])
    chosen: list[Any] = [None] * WORLD

    def rank(r: int) -> None:
        cfg = _dist.DistConfig(
            r, WORLD, r, "127.0.0.1", 1, "tok", timeout=60.0, ranks_per_node=1, secret="s" * 64
        )
        steps = [10, 20] if r != 3 else [10]  # rank 3's node misses step 20
        root = tmp_path / f"node{r}"  # a node's own disk, holding no replica
        root.mkdir()
        chosen[r] = StepAgreement(cfg, root, "global_step").choose(steps).choice

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [c.step for c in chosen] == [10] * WORLD and chosen[1].fell_back
    assert max(v.requests for v in views[1:]) <= 6  # before: WORLD + 2 per rank
    assert shared.num_keys() == 0  # before: WORLD keys per load, kept
