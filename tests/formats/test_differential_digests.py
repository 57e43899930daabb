"""Differential saves: the worker takes the trainer's digests of staged bytes (issue 37, the
hash done once). The trainer's "unchanged" is relative to what its staging slot held, never to
the last checkpoint *written*; the worker must decide links against the written file's
fingerprints alone (invariant 15). Each scenario makes a tensor unchanged versus the slot but
changed versus the last written file, then reads the step back with a plain ``dcp.load``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from statecmp import assert_same

from asyncckpt import CheckpointInfo, KeepLast, SaveFailed, Staging, SyncCheckpointEngine, faults
from asyncckpt.core import layout

BIG = (256, 1024)  # 1 MiB of float32: copy-skippable, and a file of its own
MiB = 1 << 20


def state_of() -> dict:
    g = torch.Generator().manual_seed(0)
    model = {k: torch.randn(BIG, generator=g) for k in ("a", "frozen")}
    return {"model": model, "step": 1}


def snapshot(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].items()}, "step": state["step"]}


def plain_load(root: Path, step: int, want: dict) -> dict:
    target = {"model": {k: torch.empty_like(v) for k, v in want["model"].items()}, "step": 0}
    path = root / layout.dir_name("global_step", step)
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target


def a_bytes(state: dict) -> int:
    return state["model"]["a"].nbytes


def test_the_worker_takes_the_trainers_digests_instead_of_hashing_again(tmp_path):
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        stats = [engine.save(s, state).committed_sync() for s in (1, 2, 3)]
        state["model"]["a"].data.add_(1)  # a weight sync: fingerprinted, copied, recorded
        stats.append(engine.save(4, state).committed_sync())
    # Step 1: copied, then fingerprinted from the slot (nothing held yet); so every step.
    assert [s.fingerprint_reused_bytes for s in stats] == [2 * MiB] * 4
    assert stats[2].copy_skipped_bytes == 2 * MiB and stats[2].bytes_written == 0
    assert stats[3].bytes_written > a_bytes(state) > 0  # a is written again, frozen linked
    assert stats[3].files_linked == stats[2].files_linked - 1
    assert_same(plain_load(tmp_path, 4, state), state)


def test_a_copy_skipped_against_the_slot_is_written_when_the_last_commit_differs(tmp_path):
    # Step 2 stages y into the one slot, then its commit fails: the last checkpoint written is
    # still step 1 (x). Step 3 skips the copy (the slot holds y, proved by its fingerprint);
    # a worker that took "skipped" for "unchanged" would link step 1's x into step 3. (One
    # step kept: step 3 may link from step 1, sharing files with it.)
    state = state_of()
    a = state["model"]["a"]
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        engine.save(1, state).committed_sync()
        a.data.copy_(torch.full(BIG, 7.0))  # y: no version counter moves
        faults.inject("before_metadata", "eio")
        with pytest.raises(SaveFailed):
            engine.save(2, state).committed_sync()
        want = snapshot(state)
        stats = engine.save(3, state).committed_sync()
    assert stats.copy_skipped_bytes == 2 * MiB  # the trainer's claim: the slot holds it all
    assert stats.bytes_written > a_bytes(state)  # a written: step 1's file holds x
    assert_same(plain_load(tmp_path, 3, want), want)


def test_alternating_slots_never_link_the_other_slots_bytes(tmp_path):
    # x, y, x with two slots: step 3 lands in the slot that staged step 1 (x), skips its copy,
    # while the last checkpoint written is step 2 (y).
    state = state_of()
    a = state["model"]["a"]
    x = a.clone()
    want, stats = {}, {}
    with SyncCheckpointEngine(tmp_path, keep=None, staging=Staging(max_in_flight=2)) as e:
        for step, value in ((1, x), (2, torch.full(BIG, 7.0)), (3, x), (4, x)):
            a.data.copy_(value)
            want[step] = snapshot(state)
            handle = e.save(step, state, overlap=True)
            handle.staged_sync()
            stats[step] = handle
        stats = {s: h.committed_sync() for s, h in stats.items()}
    for step in want:
        assert_same(plain_load(tmp_path, step, want[step]), want[step])
    assert any(s.copy_skipped_bytes == 2 * MiB for s in stats.values())


def test_a_format_that_does_not_link_says_so_once(tmp_path, caplog):
    # megatron_legacy (one file per rank) writes every file: the worker's link source says so
    # once per format, and gives no previous checkpoint to link from.
    import logging

    from asyncckpt.formats.differential import LinkSource

    links = LinkSource(tmp_path, "megatron", enabled=True)
    new = CheckpointInfo(1, 0.0)
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        for _ in range(2):
            assert links.previous(tmp_path / "tmp", "megatron_legacy", None, new=new) is None
        assert links.previous(tmp_path / "tmp", "torch_dist", None, new=new) is not None
    said = [r.getMessage() for r in caplog.records if "differential saves are off" in r.message]
    assert len(said) == 1 and "megatron_legacy" in said[0]
