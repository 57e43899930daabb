"""A checkpoint the engine found corrupt stops counting: quarantined (issue 28, items 5, 9); a
root whose every checkpoint was quarantined never starts from scratch in silence."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from asyncckpt import (
    CheckpointError,
    Distributed,
    KeepLast,
    NoValidCheckpoint,
    StateMismatch,
    SyncCheckpointEngine,
)
from asyncckpt.cli import main
from asyncckpt.core import layout as L
from asyncckpt.errors import CorruptCheckpoint
from asyncckpt.storage.prune import list_quarantined


def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": torch.tensor(step)}


def steps_on_disk(root) -> list[int]:
    return [c.step for c in L.scan(root, "global_step")]


def save_steps(root, steps, **kw) -> None:
    with SyncCheckpointEngine(root, **kw) as engine:
        for s in steps:
            engine.save(s, state(s))
            engine.wait()


def flip_a_byte(directory) -> None:
    shard = next(p for p in sorted(directory.iterdir()) if p.name.endswith(L.DCP_SHARD_SUFFIX))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def load_latest(root, target, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with SyncCheckpointEngine(root, **kw) as engine:
            return engine.load_latest(target)


def test_a_run_that_fell_back_past_a_corrupt_checkpoint_saves_on(tmp_path, capsys):
    save_steps(tmp_path, (800, 900, 1000))
    flip_a_byte(tmp_path / "global_step_1000")
    target = {"w": torch.zeros(64), "step": torch.tensor(0)}
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(2)) as engine:
        with pytest.warns(UserWarning, match="step 1000 .* moved to .*quarantine"):
            assert engine.load_latest(target) == 900
        assert target["w"][0] == 900.0
        # The corrupt step no longer counts: the run saves on where it resumed ...
        engine.save(950, state(950))
        engine.wait()
    # ... and it took no KeepLast place: the two newest good ones are kept.
    assert steps_on_disk(tmp_path) == [900, 950]
    assert L.read_tracker(tmp_path) == 950
    (q,) = list_quarantined(tmp_path, "global_step")
    assert q.step == 1000 and q.name == "global_step_1000" and "checksum" in q.problems[0]
    assert q.path.parent == tmp_path / L.QUARANTINE_DIR and q.path.name.startswith(
        "global_step_1000-checksum-"
    )
    assert (q.path / L.MANIFEST).exists()  # moved, nothing deleted
    # ls and verify show it, as quarantined; verify still passes on what is checkpoints.
    assert main(["ls", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["step"] for e in out["quarantined"]] == [1000]
    assert out["quarantined"][0]["path"] == str(q.path)
    assert main(["verify", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "quarantined" in text and "global_step_1000-checksum-" in text.replace("\n", "")


def test_the_tracker_moves_off_a_quarantined_step(tmp_path):
    save_steps(tmp_path, (1, 2))
    flip_a_byte(tmp_path / "global_step_2")
    assert load_latest(tmp_path, state(0)) == 1
    # It named step 2, now gone: it names the newest checkpoint left (Megatron reads it).
    assert L.read_tracker(tmp_path) == 1
    assert (tmp_path / L.SKYRL_TRACKER).read_text().strip() == "1"


def test_quarantining_the_only_checkpoint_removes_the_tracker(tmp_path):
    """Nothing left to name: the tracker kept naming the quarantined step (invariant 1);
    Megatron's loader would look for a step that is gone instead of starting fresh."""
    save_steps(tmp_path, [1])
    flip_a_byte(tmp_path / L.dir_name("global_step", 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with SyncCheckpointEngine(tmp_path) as engine:
            with pytest.raises(CheckpointError):
                engine.load_latest(state(0))
    assert steps_on_disk(tmp_path) == [] and len(list_quarantined(tmp_path, "global_step")) == 1
    assert L.read_tracker(tmp_path) is None
    assert not any((tmp_path / n).exists() for n in L.tracker_names("global_step"))


@pytest.mark.parametrize("damage", ["truncate", "manifest", "missing"])
def test_other_damage_is_quarantined_too(tmp_path, damage):
    save_steps(tmp_path, (1, 2))
    d = tmp_path / "global_step_2"
    if damage == "truncate":
        meta = d / L.DCP_METADATA
        meta.write_bytes(meta.read_bytes()[:-7])
    elif damage == "manifest":
        (d / L.MANIFEST).write_text("{not json")
    else:
        next(p for p in d.iterdir() if p.name.endswith(L.DCP_SHARD_SUFFIX)).unlink()
    assert load_latest(tmp_path, state(0)) == 1
    (q,) = list_quarantined(tmp_path, "global_step")
    kind = {"truncate": "truncated", "manifest": "manifest", "missing": "missing"}[damage]
    assert q.path.name.startswith(f"global_step_2-{kind}-")


def test_verify_on_load_false_quarantines_only_after_the_manifest_says_so(tmp_path):
    save_steps(tmp_path, (1, 2))
    flip_a_byte(tmp_path / "global_step_2")
    # Unverified, the flipped byte may even load: the damage must be in the shard's header
    # for the read to fail. Truncate the metadata instead: the read fails, the check confirms.
    meta = tmp_path / "global_step_2" / L.DCP_METADATA
    meta.write_bytes(meta.read_bytes()[:-7])
    assert load_latest(tmp_path, state(0), verify_on_load=False) == 1
    assert [q.step for q in list_quarantined(tmp_path, "global_step")] == [2]


def test_a_state_mismatch_quarantines_nothing(tmp_path):
    save_steps(tmp_path, (1, 2))
    with pytest.raises(StateMismatch):
        load_latest(tmp_path, {"w": torch.zeros(3), "step": torch.tensor(0)})
    assert steps_on_disk(tmp_path) == [1, 2]
    assert not (tmp_path / L.QUARANTINE_DIR).exists()


def test_a_read_failure_of_data_that_verifies_quarantines_nothing(tmp_path, monkeypatch):
    """The bytes match the manifest, the read fails all the same (a reader's or a target's
    problem, issue 28 item 7): the checkpoint is not damaged and stays a checkpoint."""
    from asyncckpt.formats import staged

    save_steps(tmp_path, (1, 2))

    def broken(*a, **k):
        raise RuntimeError("the reader cannot take this target")

    monkeypatch.setattr(staged, "load_into", broken)
    with pytest.raises(CheckpointError):
        load_latest(tmp_path, state(0))
    assert steps_on_disk(tmp_path) == [1, 2]
    assert not (tmp_path / L.QUARANTINE_DIR).exists()


def test_a_foreign_checkpoint_without_a_manifest_is_never_quarantined(tmp_path):
    """Plain DCP (no asyncckpt manifest): a failure cannot be told from a bad target."""
    save_steps(tmp_path, (1,))
    dcp.save(state(2), checkpoint_id=tmp_path / "global_step_2")
    meta = tmp_path / "global_step_2" / L.DCP_METADATA
    meta.write_bytes(meta.read_bytes()[:-7])
    assert load_latest(tmp_path, state(0)) == 1
    assert steps_on_disk(tmp_path) == [1, 2]
    assert not (tmp_path / L.QUARANTINE_DIR).exists()


def test_a_rank_that_does_not_prune_moves_nothing_but_saves_on(tmp_path):
    """One rank sets a corrupt checkpoint aside (the one that prunes); the others skip it,
    and their forward check ignores it too."""
    save_steps(tmp_path, (800, 900, 1000))
    flip_a_byte(tmp_path / "global_step_1000")
    target = {"w": torch.zeros(64), "step": torch.tensor(0)}
    # storage="local" with local rank 1: this process is not the one that prunes.
    with SyncCheckpointEngine(
        tmp_path, distributed=Distributed(storage="local", local_rank=1)
    ) as engine:
        with pytest.warns(UserWarning, match="another rank sets it aside"):
            assert engine.load_latest(target) == 900
        assert steps_on_disk(tmp_path) == [800, 900, 1000]
        engine.save(950, state(950))
        engine.wait()
    assert not (tmp_path / L.QUARANTINE_DIR).exists()


def test_an_explicit_load_of_a_corrupt_step_quarantines_it(tmp_path):
    save_steps(tmp_path, (1, 2))
    flip_a_byte(tmp_path / "global_step_2")
    with SyncCheckpointEngine(tmp_path) as engine:
        with pytest.raises(CorruptCheckpoint, match="quarantine"):
            engine.load(state(0), step=2)
        assert engine.load(state(0), step=1) == 1
        engine.save(2, state(2))  # the step is free again: written anew
        engine.wait()
    assert steps_on_disk(tmp_path) == [1, 2]
    assert [q.step for q in list_quarantined(tmp_path, "global_step")] == [2]


def test_a_foreign_directory_blocking_a_lower_step_is_named(tmp_path):
    """Issue 28 item 9: a hand-made global_step_1000/ with an empty .metadata is not an
    asyncckpt checkpoint; the refusal of a lower step says so, with its path."""
    foreign = tmp_path / "global_step_1000"
    foreign.mkdir()
    (foreign / L.DCP_METADATA).write_bytes(b"")
    with SyncCheckpointEngine(tmp_path) as engine:
        with pytest.raises(CheckpointError, match="not an asyncckpt checkpoint") as err:
            engine.save(10, state(10))
        assert str(foreign) in str(err.value)
        assert not os.listdir(foreign) == []  # untouched
    # A checkpoint asyncckpt wrote is refused as before (steps must increase).
    root = tmp_path / "ours"
    save_steps(root, (1000,))
    with SyncCheckpointEngine(root) as engine:
        with pytest.raises(CheckpointError, match="steps must increase") as err:
            engine.save(10, state(10))
        assert "not an asyncckpt checkpoint" not in str(err.value)


def test_plain_dcp_checkpoints_still_load_and_resume_forward(tmp_path):
    dcp.save(state(5), checkpoint_id=tmp_path / "global_step_5")
    target = {"w": torch.zeros(64), "step": torch.tensor(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no manifest; loading without checksums"
        with SyncCheckpointEngine(tmp_path) as engine:
            assert engine.load_latest(target) == 5
            engine.save(6, state(6))
            engine.wait()
    assert target["w"][0] == 5.0 and steps_on_disk(tmp_path) == [5, 6]


# ------------------------------------------------------------ a root whose every step is gone
def damage_every_step(root) -> None:
    for c in L.scan(root, "global_step"):
        flip_a_byte(c.path)


def test_the_retry_after_every_checkpoint_was_quarantined_raises_naming_them(tmp_path):
    """The first restart finds both kept steps damaged and quarantines them (it raised, right);
    the scheduler's retry found no checkpoint, returned None in silence and trained from
    step 0. It raises now, at every try, naming the quarantine."""
    save_steps(tmp_path, (1, 2), keep=KeepLast(2))
    damage_every_step(tmp_path)
    with pytest.raises(NoValidCheckpoint):
        load_latest(tmp_path, state(0))
    assert steps_on_disk(tmp_path) == []
    for _ in range(2):
        with pytest.raises(NoValidCheckpoint) as caught:
            load_latest(tmp_path, state(0))
    error = caught.value
    assert isinstance(error, asyncckpt.errors.AllCheckpointsQuarantined)
    message = str(error)
    for q in list_quarantined(tmp_path, "global_step"):
        assert str(q.path) in message
    assert "checksum" in message and "asyncckpt.start_fresh(" in message, message
    assert sorted(q.step for q in error.quarantined) == [1, 2]
    # The first restart's error is the same class, with what this load found first.
    save_steps(tmp_path / "b", (1,))
    damage_every_step(tmp_path / "b")
    with pytest.raises(asyncckpt.errors.AllCheckpointsQuarantined, match="step 1: "):
        load_latest(tmp_path / "b", state(0))


def test_start_fresh_starts_from_scratch_on_purpose_and_only_past_what_it_saw(tmp_path, caplog):
    save_steps(tmp_path, (1, 2), keep=KeepLast(2))
    damage_every_step(tmp_path)
    with pytest.raises(NoValidCheckpoint):
        load_latest(tmp_path, state(0))
    settled = asyncckpt.start_fresh(tmp_path)
    assert sorted(p.name.split("-")[0] for p in settled) == ["global_step_1", "global_step_2"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert load_latest(tmp_path, state(0)) is None  # on purpose: said in the log
    said = [r.getMessage() for r in caplog.records if "start_fresh" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path) in said[0], said
    assert load_latest(tmp_path, state(0)) is None  # and again, until a step commits
    # Nothing was deleted or moved: the damaged copies stay listed where they were.
    assert sorted(q.path for q in list_quarantined(tmp_path, "global_step")) == sorted(settled)
    # The fresh run saves step 1 again; damaged in turn, its quarantine is new: it raises.
    save_steps(tmp_path, (1,))
    assert load_latest(tmp_path, state(0)) == 1
    damage_every_step(tmp_path)
    with pytest.raises(NoValidCheckpoint):
        load_latest(tmp_path, state(0))
    with pytest.raises(asyncckpt.errors.AllCheckpointsQuarantined) as caught:
        load_latest(tmp_path, state(0))
    assert [q.step for q in caught.value.quarantined] == [1]


def test_a_root_that_never_held_a_checkpoint_still_starts_fresh_quietly(tmp_path, caplog):
    (tmp_path / "empty").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            for root in (tmp_path / "new", tmp_path / "empty"):
                with SyncCheckpointEngine(root) as engine:
                    assert engine.load_latest(state(0)) is None
    # One line each, that there is nothing to resume: of quarantine, nothing.
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("no checkpoint in" in m for m in said), said
    assert not [m for m in said if "quarantine" in m], said
    assert asyncckpt.start_fresh(tmp_path / "empty") == []  # nothing to settle: a no-op


def test_the_cli_starts_a_fully_quarantined_root_fresh_and_refuses_under_a_live_engine(
    tmp_path, capsys
):
    save_steps(tmp_path, (1, 2), keep=KeepLast(2))
    damage_every_step(tmp_path)
    with pytest.raises(NoValidCheckpoint):
        load_latest(tmp_path, state(0))
    # An engine holds the root: its own load decides, the CLI writes no note under it.
    with SyncCheckpointEngine(tmp_path):
        assert main(["start-fresh", str(tmp_path)]) == 1
        assert "live engine" in capsys.readouterr().err
    with pytest.raises(asyncckpt.errors.AllCheckpointsQuarantined):
        load_latest(tmp_path, state(0))  # still refused: nothing was settled
    assert main(["start-fresh", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(Path(p).name.split("-")[0] for p in out["settled"]) == [
        "global_step_1",
        "global_step_2",
    ]
    assert load_latest(tmp_path, state(0)) is None  # from scratch, on purpose
    assert main(["start-fresh", str(tmp_path / "missing")]) == 1
