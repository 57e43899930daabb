"""``python -m asyncckpt prune`` beside a live engine keeps what that engine protects.

``engine.protect(step)`` lived in the engine's process only: the CLI, another process, pruned
the protected step (exit 0, ``deleted: 1``). A live engine's pins are now in a file under its
root, honoured while that engine holds the root (its lock), ignored once it is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from asyncckpt import SyncCheckpointEngine
from asyncckpt.cli import main
from asyncckpt.core import layout as L

REPO = Path(__file__).resolve().parents[2]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: another process than the engine's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "asyncckpt", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _steps(root: Path) -> set[int]:
    return {c.step for c in L.scan(root, "global_step")}


def _pin_files(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".asyncckpt-pins"))


def test_cli_prune_keeps_a_step_a_live_engine_protects(tmp_path):
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        for step in (1, 2):
            engine.save(step, {"w": torch.full((4,), float(step))}).committed_sync(60)
        engine.protect(1)
        done = _cli("prune", str(tmp_path), "--keep-last", "1")
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert "deleted: nothing" in done.stdout, done.stdout
        assert f"protected by a live engine: step 1 (rank 0, pid {os.getpid()})" in done.stdout
        assert _steps(tmp_path) == {1, 2}
        done = _cli("prune", str(tmp_path), "--keep-last", "1", "--json")
        data = json.loads(done.stdout)
        assert data["deleted"] == [] and data["kept"]["1"] == ["protected"], data
        assert data["protected_by_engines"] == {"1": [{"rank": 0, "pid": os.getpid()}]}, data
        done = _cli("ls", str(tmp_path), "--json")
        by_step = {c["step"]: c for c in json.loads(done.stdout)["checkpoints"]}
        assert by_step[1]["protected"] == ["protected"], by_step
    # The pin lived as long as its engine: its file is gone, and so is the protection.
    assert _pin_files(tmp_path) == []
    done = _cli("prune", str(tmp_path), "--keep-last", "1")
    assert done.returncode == 0 and "deleted: 1" in done.stdout, (done.stdout, done.stderr)
    assert _steps(tmp_path) == {2}


def test_a_protect_before_the_start_counts_from_the_start(tmp_path, capsys):
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        engine.save(1, {"w": torch.zeros(4)}).committed_sync(60)
    engine = SyncCheckpointEngine(tmp_path, keep=None)
    engine.protect(1)  # (not started yet: the root is not this engine's)
    with engine:
        engine.save(2, {"w": torch.ones(4)}).committed_sync(60)
        assert main(["prune", str(tmp_path), "--keep-last", "1"]) == 0
        assert "deleted: nothing" in capsys.readouterr().out
    assert _steps(tmp_path) == {1, 2}


def test_pins_of_an_engine_that_is_gone_are_ignored(tmp_path, capsys):
    """A killed engine leaves its file; nobody holds its lock, so the pins no longer count
    (and a new engine of that rank, another pid, does not inherit them)."""
    from asyncckpt.storage.pinfile import publish

    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        for step in (1, 2):
            engine.save(step, {"w": torch.zeros(4)}).committed_sync(60)
    publish(tmp_path, 0, [1])  # as a killed engine left it (this pid holds no lock now)
    assert _pin_files(tmp_path) == [".asyncckpt-pins.rank0.json"]
    fake = json.loads((tmp_path / ".asyncckpt-pins.rank0.json").read_text())
    assert fake["pid"] == os.getpid() and fake["steps"] == [1]
    with SyncCheckpointEngine(tmp_path, keep=None):
        fake["pid"] = os.getpid() + 1  # another engine's pid: not the lock's holder
        (tmp_path / ".asyncckpt-pins.rank0.json").write_text(json.dumps(fake))
        assert main(["prune", str(tmp_path), "--keep-last", "1", "--dry-run"]) == 0
        assert "would delete: 1" in capsys.readouterr().out
    fake["pid"] = os.getpid()
    (tmp_path / ".asyncckpt-pins.rank0.json").write_text(json.dumps(fake))
    assert main(["prune", str(tmp_path), "--keep-last", "1"]) == 0  # no engine holds the root
    out = capsys.readouterr().out
    assert "deleted: 1" in out and "live engine" not in out, out


def test_a_protect_while_the_cli_verifies_is_seen_before_the_deletion(
    tmp_path, capsys, monkeypatch
):
    """The CLI reads every kept checkpoint before deleting (minutes on a large root); a pin
    written meanwhile is looked at again, under the pins' lock, before each deletion."""
    from asyncckpt.storage.local import LocalStore

    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        for step in (1, 2, 3):
            engine.save(step, {"w": torch.zeros(4)}).committed_sync(60)
        check = LocalStore.check

        def protect_while_reading(self, *args, **kwargs):
            engine.protect(1)  # (the engine's thread of a user, while the CLI reads)
            return check(self, *args, **kwargs)

        monkeypatch.setattr(LocalStore, "check", protect_while_reading)
        assert main(["prune", str(tmp_path), "--keep-last", "1"]) == 0
        monkeypatch.undo()
        out = capsys.readouterr().out
        assert "deleted: 2" in out and "protected by a live engine: step 1" in out, out
        assert _steps(tmp_path) == {1, 3}


def test_of_two_threads_protecting_at_once_the_last_file_holds_both_pins(tmp_path, monkeypatch):
    """Each ``protect`` writes the whole set; one that read it before another thread's pin
    but wrote after it dropped that pin from the file."""
    import contextlib
    import threading
    import time

    from asyncckpt.storage import pinfile

    pinned = {1}
    other_done = threading.Event()
    real = pinfile._pins_locked
    calls = []

    @contextlib.contextmanager
    def first_waits(root):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:  # the first protect is overtaken before it has the lock
            assert other_done.wait(60)
        with real(root):
            yield

    monkeypatch.setattr(pinfile, "_pins_locked", first_waits)
    first = threading.Thread(target=pinfile.publish, args=(tmp_path, 0, pinned), name="first")
    first.start()
    while not calls:  # (the first is in)
        time.sleep(0.01)
    pinned.add(2)
    pinfile.publish(tmp_path, 0, pinned)
    other_done.set()
    first.join(60)
    assert json.loads((tmp_path / ".asyncckpt-pins.rank0.json").read_text())["steps"] == [1, 2]
