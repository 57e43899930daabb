"""Corruption of committed checkpoints: detected by the manifest checksums, loudly survived.

Each case damages the newest checkpoint of a root the engine wrote (a flipped byte, a truncated
or deleted shard, DCP's metadata, the manifest) and checks that ``load_latest`` falls back to
the previous checkpoint with a warning and an error log, that ``verify`` and
``python -m asyncckpt verify`` name the damage (exit 1), and that with nothing good left loading
fails with ``NoValidCheckpoint``. A garbage or dangling tracker is reported by ``verify``;
loading does not trust the tracker and is not misled by it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncckpt import (
    CheckpointEngine,
    NoValidCheckpoint,
    SyncCheckpointEngine,
    verify,
)
from asyncckpt.cli import main
from asyncckpt.core import layout as L
from asyncckpt.storage.prune import list_quarantined

STEPS = (1, 2, 3)


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(2000, generator=g), "b": torch.randn(3, generator=g)},
        "optim": {"m": torch.rand(2000, generator=g, dtype=torch.float64)},
        "step": step,
    }


def blank() -> dict:
    s = state_at(0)
    for group in ("model", "optim"):
        for t in s[group].values():
            t.zero_()
    s["step"] = -1
    return s


def assert_state(got: dict, step: int) -> None:
    want = state_at(step)
    for group in ("model", "optim"):
        for k, v in want[group].items():
            assert torch.equal(got[group][k], v), (group, k)
    assert got["step"] == step


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("template") / "ckpts"
    with SyncCheckpointEngine(root) as engine:
        for s in STEPS:
            engine.save(s, state_at(s)).committed_sync()
    return root


@pytest.fixture
def root(template, tmp_path) -> Path:
    r = tmp_path / "ckpts"
    shutil.copytree(template, r)
    return r


def shard(root: Path, step: int) -> Path:
    """The largest data file of a checkpoint."""
    d = root / L.dir_name("global_step", step)
    return max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


CORRUPTIONS = {
    "flipped_byte": (lambda r: flip_byte(shard(r, 3)), "checksum mismatch"),
    "flipped_last_byte": (lambda r: flip_byte(shard(r, 3), -1), "checksum mismatch"),
    "truncated_shard": (lambda r: truncate(shard(r, 3)), "truncated"),
    "empty_shard": (lambda r: shard(r, 3).write_bytes(b""), "truncated"),
    "deleted_shard": (lambda r: shard(r, 3).unlink(), "missing"),
    "deleted_dcp_metadata": (lambda r: (r / "global_step_3" / ".metadata").unlink(), "missing"),
    "garbage_manifest": (
        lambda r: (r / "global_step_3" / L.MANIFEST).write_text("{not json"),
        "unreadable manifest",
    ),
    "extra_bytes": (
        lambda r: shard(r, 3).write_bytes(shard(r, 3).read_bytes() + b"junk"),
        "grown",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_latest_falls_back_loudly(root, case, caplog, capsys):
    damage, problem = CORRUPTIONS[case]
    damage(root)
    # verify: step 3 bad, named with its problem; 1 and 2 fine
    rep = verify(root)
    assert not rep.ok
    status = {c.step: c for c in rep.checkpoints}
    assert status[1].ok and status[2].ok and not status[3].ok
    assert any(problem in p for p in status[3].problems), status[3].problems
    # the CLI: exit 1, names the bad step and the problem
    code = main(["verify", str(root)])
    out = capsys.readouterr().out
    assert code == 1
    assert "BAD" in out and problem in out
    code = main(["verify", "--json", str(root)])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["ok"] is False and report["newest_good"] == 2
    assert [c["ok"] for c in report["checkpoints"]] == [True, True, False]
    # load_latest: falls back to step 2, with one warning naming the problem; not the same
    # message in the log as well (issue 32: one channel)
    target = blank()
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        with pytest.warns(UserWarning, match=r"checkpoint step 3 .* is unusable") as record:
            step = SyncCheckpointEngine(root).load_latest(target)
    assert step == 2
    assert_state(target, 2)
    assert any(problem in str(w.message) for w in record), [str(w.message) for w in record]
    assert not [r for r in caplog.records if "unusable" in r.getMessage()], caplog.text
    # ... and moved step 3 into .quarantine/ (issue 28 item 5): no longer a checkpoint, so
    # verify passes, and shows it with its problem.
    code = main(["verify", "--json", str(root)])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and [c["step"] for c in report["checkpoints"]] == [1, 2]
    (q,) = report["quarantined"]
    assert q["step"] == 3 and any(problem in p for p in q["problems"]), q


async def test_fallback_through_the_async_engine(root, anyio_backend, caplog):
    flip_byte(shard(root, 3))
    target = blank()
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        with pytest.warns(UserWarning, match="unusable.*checksum mismatch"):
            assert await CheckpointEngine(root).load_latest(target) == 2
    assert_state(target, 2)
    assert "unusable" not in caplog.text  # one channel: the warning


def test_several_bad_falls_back_as_far_as_needed(root):
    flip_byte(shard(root, 3))
    truncate(shard(root, 2))
    target = blank()
    with pytest.warns(UserWarning) as record:
        assert SyncCheckpointEngine(root).load_latest(target) == 1
    assert_state(target, 1)
    messages = " ".join(str(w.message) for w in record)
    assert "step 3" in messages and "step 2" in messages
    # both set aside (issue 28 item 5): only step 1 is a checkpoint now
    assert [(c.step, c.ok) for c in verify(root).checkpoints] == [(1, True)]
    assert sorted(q.step for q in list_quarantined(root, "global_step")) == [2, 3]


def test_nothing_good_left_is_a_clear_error(root):
    for s in STEPS:
        flip_byte(shard(root, s))
    with pytest.warns(UserWarning):
        with pytest.raises(NoValidCheckpoint) as info:
            SyncCheckpointEngine(root).load_latest(blank())
    msg = str(info.value)
    assert str(root) in msg and all(f"step {s}" in msg for s in STEPS)
    assert main(["verify", str(root)]) == 1


def test_an_older_bad_checkpoint_does_not_stop_loading_the_newest(root, recwarn):
    flip_byte(shard(root, 1))
    target = blank()
    assert SyncCheckpointEngine(root).load_latest(target) == 3
    assert_state(target, 3)
    assert not [w for w in recwarn if "unusable" in str(w.message)]
    rep = verify(root)
    assert [c.ok for c in rep.checkpoints] == [False, True, True] and not rep.ok


def test_damage_without_a_manifest_still_falls_back(root):
    """No checksums to compare (the manifest is gone): DCP's own read error (a
    ``CheckpointException``, which is a BaseException) must still lead to the fallback."""
    (root / "global_step_3" / L.MANIFEST).unlink()
    truncate(shard(root, 3))
    target = blank()
    with pytest.warns(UserWarning) as record:
        assert SyncCheckpointEngine(root).load_latest(target) == 2
    assert_state(target, 2)
    messages = [str(w.message) for w in record]
    assert any("no manifest" in m for m in messages)
    assert any("step 3" in m and "unusable" in m for m in messages)
    assert not verify(root).ok


@pytest.mark.parametrize("text", ["garbage\n", "", "-1\n", "3.5\n"])
def test_garbage_tracker(root, text, capsys):
    (root / L.TRACKER).write_text(text)
    rep = verify(root)
    assert rep.tracker_problem and "not a step number" in rep.tracker_problem
    assert all(c.ok for c in rep.checkpoints) and not rep.ok
    target = blank()
    assert SyncCheckpointEngine(root).load_latest(target) == 3  # not misled by the tracker
    assert_state(target, 3)
    assert main(["verify", str(root)]) == 1
    assert "tracker: BAD" in capsys.readouterr().out


def test_dangling_tracker(root, capsys):
    (root / L.TRACKER).write_text("7\n")
    rep = verify(root)
    assert rep.tracker_problem and "step 7" in rep.tracker_problem
    target = blank()
    assert SyncCheckpointEngine(root).load_latest(target) == 3
    assert main(["verify", str(root)]) == 1
    assert "names step 7" in capsys.readouterr().out


def test_tracker_naming_a_deleted_checkpoint(root):
    shutil.rmtree(root / "global_step_3")
    rep = verify(root)
    assert rep.tracker_step == 3 and "not committed" in rep.tracker_problem
    target = blank()
    assert SyncCheckpointEngine(root).load_latest(target) == 2
    assert_state(target, 2)


def test_a_good_root_verifies(root, capsys):
    rep = verify(root)
    assert rep.ok and [c.step for c in rep.checkpoints] == list(STEPS)
    assert rep.tracker_step == 3 and rep.leftovers == []
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "OK: 3 checkpoint(s) verified" in out and "tracker: 3" in out


def test_leftovers_are_reported_not_failed(root, capsys):
    (root / L.tmp_name("global_step", 4, "dead")).mkdir()
    rep = verify(root)
    assert rep.ok and rep.leftovers
    assert main(["verify", str(root)]) == 0
    assert "leftovers" in capsys.readouterr().out


def test_empty_and_missing_roots(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert verify(empty).ok and verify(empty).checkpoints == []
    assert main(["verify", str(empty)]) == 1  # nothing to verify is not "OK"
    assert f"no checkpoints found in {empty} (layout global_step)" in capsys.readouterr().err
    assert SyncCheckpointEngine(empty).load_latest(blank()) is None
    assert main(["verify", str(tmp_path / "nope")]) == 1
    assert "no such directory" in capsys.readouterr().err


def test_megatron_layout_is_detected(tmp_path, capsys):
    root = tmp_path / "meg"
    with SyncCheckpointEngine(root, layout="megatron", format="dcp") as engine:
        engine.save(5, state_at(5)).committed_sync()
    assert main(["verify", "--json", str(root)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"] == "megatron" and report["tracker"] == 5
    flip_byte(shard_meg := max((root / "iter_0000005").glob("*.distcp"), key=os.path.getsize))
    assert shard_meg.exists()
    assert main(["verify", str(root)]) == 1


def test_cli_as_a_module(root):
    flip_byte(shard(root, 3))
    out = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "verify", str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr
    assert "checksum mismatch" in out.stdout and "newest good: step 2" in out.stdout


def test_manifests_record_crc32c_and_older_crc32_manifests_still_verify(tmp_path):
    """New manifests checksum with CRC-32C; one written before (zlib crc32) still verifies,
    loads, and still catches a flipped byte."""
    import json
    import zlib

    from asyncckpt import SyncCheckpointEngine, verify
    from asyncckpt.storage.manifest import checksum

    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, {"w": torch.arange(1000.0)})
    d = tmp_path / "global_step_1"
    manifest = json.loads((d / L.MANIFEST).read_text())
    shard = d / "__0_0.distcp"
    entry = manifest["files"]["__0_0.distcp"]
    assert set(entry) == {"size", "crc32c"} and entry["crc32c"] == checksum(shard.read_bytes())
    # The same checkpoint as an older release wrote it: crc32 entries.
    for rel, e in manifest["files"].items():
        e["crc32"] = zlib.crc32((d / rel).read_bytes())
        del e["crc32c"]
    (d / L.MANIFEST).write_text(json.dumps(manifest))
    assert verify(tmp_path).ok
    target = {"w": torch.zeros(1000)}
    assert SyncCheckpointEngine(tmp_path).load_latest(target) == 1
    assert torch.equal(target["w"], torch.arange(1000.0))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 1
    shard.write_bytes(bytes(data))
    bad = [c for c in verify(tmp_path).checkpoints if not c.ok]
    assert bad and "checksum mismatch (crc32 " in bad[0].problems[0]


def test_a_large_file_is_checksummed_in_parallel_parts_to_the_same_value(tmp_path, monkeypatch):
    """Parts checksummed by several threads combine into the whole file's CRC (crc32c, and
    zlib's crc32 for older manifests); any flipped byte in any part changes it."""
    import random
    import zlib

    from crc32c import crc32c

    from asyncckpt.storage import manifest as M

    monkeypatch.setattr(M, "_PART_BYTES", 1000)
    monkeypatch.setattr(M, "_verify_threads", lambda: 3)
    data = bytearray(random.Random(0).randbytes(10_007))
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(data))
    seen = []
    assert M.checksum_file(path, seen.append) == (crc32c(bytes(data)), len(data))
    assert sum(seen) == len(data) and len(seen) > 3  # read in parts
    assert M.checksum_file(path, algorithm="crc32") == (zlib.crc32(bytes(data)), len(data))
    for pos in (0, 4999, 10_006):
        flipped = bytearray(data)
        flipped[pos] ^= 0x40
        path.write_bytes(bytes(flipped))
        assert M.checksum_file(path)[0] != crc32c(bytes(data)), pos
    for a, b in ((b"", b"x"), (b"abc", b""), (bytes(300), bytes(700))):
        assert M.crc_combine(crc32c(a), crc32c(b), len(b), M._POLYNOMIALS["crc32c"]) == crc32c(
            a + b
        )
