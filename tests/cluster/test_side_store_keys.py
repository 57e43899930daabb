"""The side store stays bounded over a long run: each save's job group leaves one key per rank
in it (gloo's address), which rank 0's worker removes once every rank has left that group.

Before: nothing removed them, so rank 0's worker (which serves the store) grew by N keys per
save for as long as the run lasted.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from test_multirank import make_state, run_ranks

from asyncckpt import Distributed
from asyncckpt.cluster import dist as _dist
from asyncckpt.cluster import sidekeys as SK

SAVES = 8


def _side_store_keys(engine) -> int:
    from asyncckpt.testing import parts

    cfg = parts(engine).dist_cfg
    return dist.TCPStore(cfg.host, cfg.port, None, False).num_keys()


def save_and_count_keys(rank: int, world: int, root: str) -> dict:
    """Save ``SAVES`` steps; on rank 0, the side store's key count after the 2nd and the last
    (the removal runs on a thread of rank 0's worker: wait until it caught up, at most 60 s)."""
    from asyncckpt import SyncCheckpointEngine

    counts = {}
    with SyncCheckpointEngine(root, distributed=Distributed(timeout=60)) as engine:
        for step in range(1, SAVES + 1):
            engine.save(step, make_state(rank, world, step)).committed_sync(timeout=120)
            if rank == 0 and step in (2, SAVES):
                deadline = time.monotonic() + 60
                n = _side_store_keys(engine)
                while step == SAVES and n > counts[2] and time.monotonic() < deadline:
                    time.sleep(0.1)
                    n = _side_store_keys(engine)
                counts[step] = n
    return counts


@pytest.mark.integration
def test_side_store_keys_stay_bounded_over_many_saves(tmp_path: Path) -> None:
    out = run_ranks(save_and_count_keys, 2, tmp_path, str(tmp_path / "ckpt"))
    counts = out[0]
    # Before: 2 more keys per save (16 + the run's own after 8 saves against 4 + after 2).
    assert counts[SAVES] <= counts[2], counts


def test_forget_removes_only_the_given_jobs_keys() -> None:
    store = dist.HashStore()
    for key in ("1.0/0//cpu//0/0", "1.0/0//cpu//0/1", "2.0/0//cpu//0/0", "memory/1"):
        store.set(f"asyncckpt/tok/{key}", "x")
    store.set("asyncckpt/other/1.0/0//cpu//0/0", "x")  # another run's
    assert SK.forget(store, "tok", ["1.0"]) == 2
    assert store.num_keys() == 3
    assert store.check(["asyncckpt/tok/2.0/0//cpu//0/0", "asyncckpt/tok/memory/1"])
    assert store.check(["asyncckpt/other/1.0/0//cpu//0/0"])
    assert SK.forget(store, "tok", []) == 0


class _NoListing:
    """A store that can neither list nor delete keys."""

    def list_keys(self) -> list[str]:
        raise NotImplementedError("list_keys")


def test_a_store_without_listing_is_said_once(monkeypatch, caplog) -> None:
    from asyncckpt.cluster import dist as _dist

    monkeypatch.setattr(_dist, "side_store", lambda cfg: _NoListing())
    monkeypatch.setattr(SK, "forget", lambda store, token, tags: store.list_keys())
    keys = SK.JobKeys()
    cfg = _dist.DistConfig(0, 2, 0, "127.0.0.1", 1, "tok")
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        keys._submit(cfg, ["1.0"])
        keys._submit(cfg, ["2.0"])
        keys.close()
    assert keys.unsupported is not None and "list_keys" in keys.unsupported
    said = [r for r in caplog.records if "cannot list or delete" in r.getMessage()]
    assert len(said) == 1


def test_rank_0_frees_a_group_once_a_later_group_closed_cleanly(monkeypatch) -> None:
    """A group's keys go only after a later job's group closed without an error on rank 0
    (its gather returned: every rank had left the earlier groups); a failed group frees none."""
    from asyncckpt.cluster import dist as _dist

    monkeypatch.setattr(_dist, "job_group", lambda cfg, tag, **_: contextlib.nullcontext(tag))
    keys = SK.JobKeys()
    freed: list[list[str]] = []
    monkeypatch.setattr(keys, "_submit", lambda cfg, tags: freed.append(tags))
    cfg = _dist.DistConfig(0, 2, 0, "127.0.0.1", 1, "tok")
    with keys.group(cfg, "1.0"):
        pass
    assert freed == []  # its own keys: a peer may still connect in it
    with pytest.raises(RuntimeError), keys.group(cfg, "2.0"):
        raise RuntimeError("a peer died")
    assert freed == []  # a failed group proves nothing about the peers
    with keys.group(cfg, "3.0"):
        pass
    assert freed == [["1.0", "2.0"]]
    other = SK.JobKeys()  # rank 1 frees nothing: rank 0 serves the store and decides
    monkeypatch.setattr(other, "_submit", lambda cfg, tags: freed.append(tags))
    for tag in ("1.0", "2.0"):
        with other.group(_dist.DistConfig(1, 2, 1, "127.0.0.1", 1, "tok"), tag):
            pass
    assert freed == [["1.0", "2.0"]] and other.joined == []


@pytest.mark.parametrize(
    ("cause", "kind"),
    [
        ("UncommittedResume: step 3 was loaded ... its commit failed", "UncommittedResume"),
        ("NoValidCheckpoint: no step on every rank", "NoValidCheckpoint"),
        ("ChecksumMismatch: a.distcp", "RuntimeError"),  # not a class of asyncckpt.errors
        ("OSError: [Errno 28] No space left on device", "RuntimeError"),
        ("KeyError: 'x'", "RuntimeError"),
        ("no colon at all", "RuntimeError"),
    ],
)
def test_a_failure_rank_0_published_is_raised_as_its_own_class_on_the_others(cause, kind):
    """Rank 0's ``start()`` failing publishes its error for the other ranks (instead of letting
    them wait out the timeout); each raises it as the same asyncckpt error class, so a trainer
    catching ``UncommittedResume`` catches it on every rank (before: RuntimeError on ranks > 0),
    and anything else as RuntimeError; the message names rank 0 and the cause."""
    from asyncckpt import errors

    e = _dist.relayed_failure("rank 0 could not start its checkpoint engine", cause)
    assert type(e).__name__ == kind
    assert str(e) == f"rank 0 could not start its checkpoint engine: {cause}"
    if kind != "RuntimeError":
        assert isinstance(e, errors.CheckpointError)
