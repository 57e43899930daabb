"""The check before a load (precheck.py): every file against its manifest entry, all files at
once, checksummed in place through a mapping (or, where that is refused, through a buffer)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from crc32c import crc32c

from asyncckpt.formats import precheck, wholefiles


def entry(data: bytes) -> dict:
    return {"size": len(data), "crc32c": crc32c(data)}


@pytest.fixture(params=["mapped", "buffered"])
def mode(request, monkeypatch) -> str:
    monkeypatch.setattr(wholefiles, "PART_BYTES", 100_000)  # files in several parts, combined
    monkeypatch.setattr(wholefiles, "CHUNK_BYTES", 30_000)
    monkeypatch.setattr(precheck, "CHUNK_BYTES", 30_000)  # several populates per part
    monkeypatch.setattr(precheck, "_mapping_refused", request.param == "buffered")
    return request.param


def test_every_kind_of_damage_is_found_and_good_files_pass(tmp_path: Path, mode: str):
    rng = random.Random(0)
    good, flipped, short = (rng.randbytes(n) for n in (1_000_003, 250_001, 4096))
    (tmp_path / "good").write_bytes(good)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "flipped").write_bytes(flipped[:-1] + bytes([flipped[-1] ^ 1]))
    (tmp_path / "short").write_bytes(short[:-1])
    files = {
        "good": entry(good),
        "empty": entry(b""),
        "flipped": entry(flipped),
        "short": entry(short),
        "missing": entry(b"x"),
    }
    seen: list[int] = []
    fallbacks = precheck.fallbacks
    found = precheck.check_files(tmp_path, files, on_bytes=seen.append)
    assert found.unreadable == []
    assert sorted(d.split(":")[0] for d in found.damage) == ["flipped", "missing", "short"]
    assert any("checksum mismatch" in d for d in found.damage)
    assert any("truncated" in d for d in found.damage)
    assert sum(seen) == len(good) + len(flipped)  # what was read: the files of right size
    assert (precheck.fallbacks > fallbacks) == (mode == "buffered")


def test_a_checkpoint_that_matches_has_nothing_to_report(tmp_path: Path, mode: str):
    data = random.Random(1).randbytes(777_777)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(data[:1000])
    found = precheck.check_files(tmp_path, {"a": entry(data), "b": entry(data[:1000])})
    assert found == precheck.Checked()


def test_several_files_are_checked_at_once(tmp_path: Path, monkeypatch):
    """Not one file after another: a cold disk gets several reads at a time. Two checks must
    be in flight together to pass the barrier (its timeout only ends a sequential check)."""
    monkeypatch.setattr(precheck, "_mapping_refused", False)
    data = random.Random(2).randbytes(4096)
    files = {}
    for i in range(8):
        (tmp_path / f"f{i}").write_bytes(data)
        files[f"f{i}"] = entry(data)
    barrier = threading.Barrier(2, timeout=30)
    lock = threading.Lock()
    calls: list[int] = []
    met: list[bool] = []
    real = precheck._checksum_mapped

    def together(part, on_bytes):
        with lock:
            calls.append(1)
            first_two = len(calls) <= 2
        if first_two:
            try:
                barrier.wait()
                met.append(True)
            except threading.BrokenBarrierError:
                met.append(False)
        return real(part, on_bytes)

    monkeypatch.setattr(precheck, "_checksum_mapped", together)
    assert precheck.check_files(tmp_path, files) == precheck.Checked()
    assert met == [True, True]
