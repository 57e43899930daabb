"""A verified load (issue 34 item 2): every checksum is checked before a byte goes into the
target (invariant 11), then each file is read once, in parallel parts, straight into the
targets; damage falls back, names the file, and changes nothing of the target."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from crc32c import crc32c

from asyncckpt import CorruptCheckpoint, SyncCheckpointEngine
from asyncckpt.core import layout as L


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)},
        "small": torch.randn(3, generator=g),
        "step": step,
    }


def blank() -> dict:
    s = state_at(0)
    for t in s["model"].values():
        t.zero_()
    s["small"].zero_()
    s["step"] = -1
    return s


def data_file(root: Path, step: int) -> Path:
    d = root / L.dir_name("global_step", step)
    return max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)


def data_bytes(root: Path, step: int) -> int:
    """The size of every shard file of ``step`` (a large tensor has a file of its own)."""
    d = root / L.dir_name("global_step", step)
    return sum(p.stat().st_size for p in d.glob("*.distcp"))


def save(root: Path, steps: list[int]) -> None:
    with SyncCheckpointEngine(root) as engine:
        for s in steps:
            engine.save(s, state_at(s)).committed_sync()


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's per-process I/O counts")
def test_a_verified_load_copies_the_files_once(tmp_path):
    """The check maps the files' pages and checksums them where they are (no copy: counted
    by ``rchar`` as nothing), then the reader's one read of each file (in parallel parts,
    straight into the targets): one copy of the bytes, as a raw read makes, not DCP's read of
    each record on top. (Before, the check read every file into a buffer: 2x.) Where the
    mapping is refused the check reads through a buffer, and says so in ``fallbacks``."""
    from asyncckpt.formats import precheck

    save(tmp_path, [1])
    size = data_bytes(tmp_path, 1)
    engine = SyncCheckpointEngine(tmp_path)
    target = blank()
    fallbacks, before = precheck.fallbacks, bytes_read()
    assert engine.load_latest(target) == 1
    read = bytes_read() - before
    assert torch.equal(target["model"]["w3"], state_at(1)["model"]["w3"])
    copies = 2 if precheck.fallbacks > fallbacks else 1
    assert copies * size <= read < (copies + 0.3) * size, (read, size, copies)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's per-process I/O counts")
def test_read_checkpoint_verifies_with_the_loads_check_and_copies_the_files_once(tmp_path):
    """``read_checkpoint`` (Lightning's path) checks with the load's check (``precheck``):
    pages checksummed in place, then the format's one read. (Before, it read every file into
    a buffer one after another to checksum it: twice the bytes of a read without the check.)"""
    from asyncckpt import read_checkpoint
    from asyncckpt.formats import precheck

    save(tmp_path, [1])
    size = data_bytes(tmp_path, 1)
    fallbacks, before = precheck.fallbacks, bytes_read()
    out = read_checkpoint(tmp_path / L.dir_name("global_step", 1))
    read = bytes_read() - before
    assert torch.equal(out["model"]["w3"], state_at(1)["model"]["w3"])
    copies = 2 if precheck.fallbacks > fallbacks else 1
    assert copies * size <= read < (copies + 0.3) * size, (read, size, copies)


def test_read_checkpoint_finds_damage_and_names_the_file(tmp_path):
    save(tmp_path, [1])
    path = data_file(tmp_path, 1)
    flip(path, path.stat().st_size // 2)
    from asyncckpt import read_checkpoint

    with pytest.raises(CorruptCheckpoint, match=rf"{path.name}: checksum mismatch"):
        read_checkpoint(tmp_path / L.dir_name("global_step", 1))
    assert read_checkpoint(tmp_path / L.dir_name("global_step", 1), verify=False)["step"] == 1


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


def test_damage_found_while_reading_falls_back_and_applied_no_object(tmp_path):
    save(tmp_path, [1, 2])
    flip(data_file(tmp_path, 2), data_file(tmp_path, 2).stat().st_size // 2)
    target = blank()
    with pytest.warns(UserWarning, match=r"step 2 .*unusable.*checksum mismatch"):
        assert SyncCheckpointEngine(tmp_path).load_latest(target) == 1
    want = state_at(1)
    assert all(torch.equal(target["model"][k], v) for k, v in want["model"].items())
    assert torch.equal(target["small"], want["small"]) and target["step"] == 1
    assert not (tmp_path / L.dir_name("global_step", 2)).exists()  # quarantined


def test_with_nothing_older_damage_changes_nothing_of_the_target(tmp_path):
    """Invariant 11, with tensors large enough to be read in place (16 MiB): checked while
    reading, the tensors before the damage already held the damaged checkpoint's bytes."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(1)
    state = {"model": {f"w{i}": torch.randn(4096, 1024, generator=g) for i in range(4)}}
    state["step"] = 1
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state).committed_sync()
    path = data_file(tmp_path, 1)
    where = dcp.FileSystemReader(str(path.parent)).read_metadata().storage_data
    w3 = next(info for index, info in where.items() if index.fqn == "model.w3")
    flip(path, w3.offset + w3.length // 2)  # in the middle of a large tensor's bytes
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        SyncCheckpointEngine(tmp_path).load(target, step=1)
    assert target["step"] == -1
    assert [k for k, t in target["model"].items() if t.any()] == []


def test_the_reader_waits_for_the_check_running_beside_it(tmp_path, monkeypatch):
    """The check of the data files runs on a thread of its own while the reader plans and
    locates its records (precheck.Pending); the reader waits for it before the first byte
    goes into a target. Here the check takes a second and then finds damage: nothing of the
    target changed (invariant 11), however far the reader got meanwhile."""
    import time

    from asyncckpt.trainer import restore

    state = {"model": {f"w{i}": torch.randn(1024, 1024) for i in range(4)}, "step": 1}
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state).committed_sync()
    real = restore.check_files

    def slow_damage(directory, files, **kw):
        found = real(directory, files, **kw)
        if any(name.endswith(".distcp") for name in files):  # the data files' check
            time.sleep(1.0)
            found.damage.append("w: checksum mismatch (made up by the test)")
        return found

    monkeypatch.setattr(restore, "check_files", slow_damage)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}
    with pytest.raises(CorruptCheckpoint, match="made up by the test"):
        SyncCheckpointEngine(tmp_path).load(target, step=1)
    assert target["step"] == -1
    assert [k for k, t in target["model"].items() if t.any()] == []


def test_bytes_no_key_asks_for_are_checked_too(tmp_path):
    """strict=False without a key: its bytes are not loaded, yet the file is checked whole
    (as the separate pass did), so damage there is still found."""
    save(tmp_path, [1, 2])
    path = data_file(tmp_path, 2)
    target = blank()
    del target["model"]["w0"]
    # Damage every 64 KiB: some of it lies in w0's bytes, the key the target does not ask for.
    for at in range(4096, path.stat().st_size, 64 << 10):
        flip(path, at)
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert SyncCheckpointEngine(tmp_path).load_latest(target, strict=False) == 1


@pytest.mark.parametrize("checked", [True, False])
def test_read_files_puts_every_span_in_place_in_parallel_parts(tmp_path, monkeypatch, checked):
    from asyncckpt.formats import wholefiles as W

    monkeypatch.setattr(W, "PART_BYTES", 100_000)  # many parts, combined
    monkeypatch.setattr(W, "CHUNK_BYTES", 30_000)  # several reads per part
    rng = random.Random(0)
    data = rng.randbytes(1_000_003)
    path = tmp_path / "f"
    path.write_bytes(data)
    spans, at = [], 7
    while at < len(data) - 70_000:
        n = rng.randrange(1, 70_000)
        spans.append((at, bytearray(n)))
        at += n + rng.randrange(0, 300)
    fd = os.open(path, os.O_RDONLY)
    try:
        want = {"size": len(data), "crc32c": crc32c(data)} if checked else None
        f = W.FileRead("f", fd, len(data), [W.Span(o, memoryview(b)) for o, b in spans], want)
        assert W.read_files([f], threads=3) == {}
        assert all(bytes(b) == data[o : o + len(b)] for o, b in spans)
        if checked:
            bad = dict(want, crc32c=want["crc32c"] ^ 1)
            f = W.FileRead("f", fd, len(data), [], bad)
            assert "checksum mismatch" in W.read_files([f], threads=3)["f"]
            # a file shorter than the size it was opened with: truncated
            f = W.FileRead("f", fd, len(data) + 10, [], dict(want, size=len(data) + 10))
            assert "truncated" in W.read_files([f], threads=3)["f"]
    finally:
        os.close(fd)
