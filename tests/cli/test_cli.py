"""``python -m asyncckpt ls | prune``: output and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from asyncckpt import ThrottleConfig
from asyncckpt.cli import main
from asyncckpt.core import layout as L

REPO = Path(__file__).resolve().parents[2]


def make_ckpt(
    root: Path, step: int, layout: str = "global_step", loss: float | None = None
) -> Path:
    """A committed checkpoint as the engine leaves it: one shard and a manifest."""
    d = root / L.dir_name(layout, step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 2048)
    manifest = {
        "step": step,
        "committed_at": 1_700_000_000.0 + step,
        "metrics": {} if loss is None else {"loss": loss},
        "bytes": 2048,
        "files": {"__0_0.distcp": {"size": 2048, "crc32": zlib.crc32(b"x" * 2048)}},
        "run_id": "run-a",
    }
    (d / L.MANIFEST).write_text(json.dumps(manifest))
    return d


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpts"
    for s in range(1, 7):
        make_ckpt(r, s * 10, loss=abs(s - 2) + 0.25)
    (r / L.TRACKER).write_text("60")
    (r / L.tmp_name("global_step", 70, "dead")).mkdir()
    return r


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_table(root, capsys):
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    for s in range(10, 70, 10):
        assert str(s) in out
    assert "newest, tracker" in out
    assert "loss=0.25" in out
    assert "2.0 KiB" in out
    assert "leftover: .tmp-global_step_70-dead" in out


def test_ls_json_and_megatron(tmp_path, capsys):
    r = tmp_path / "m"
    make_ckpt(r, 50, layout="megatron", loss=1.5)
    make_ckpt(r, 100, layout="megatron")
    (r / L.TRACKER).write_text("50")
    code, out, _ = run(capsys, "ls", str(r), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["layout"] == "megatron" and data["tracker"] == 50
    by_step = {c["step"]: c for c in data["checkpoints"]}
    assert by_step[50]["protected"] == ["tracker"] and by_step[50]["metrics"] == {"loss": 1.5}
    assert by_step[100]["protected"] == ["newest"]
    assert data["usage"]["checkpoints"] == 2


def test_prune_dry_run_then_prune(root, capsys):
    before = set(os.listdir(root))
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "2", "--dry-run")
    assert code == 0
    assert "would delete: 10, 20, 30, 40" in out
    assert set(os.listdir(root)) == before

    code, out, _ = run(
        capsys, "prune", str(root), "--keep-last", "2", "--keep-best", "1", "--metric", "loss"
    )
    assert code == 0
    assert "deleted: 10, 30, 40" in out
    assert "KeepLast(2) | KeepBest(1, 'loss')" in out
    assert {c.step for c in L.scan(root, "global_step")} == {20, 50, 60}
    assert (root / L.tmp_name("global_step", 70, "dead")).exists()  # only with --clean-leftovers


def test_prune_json_keep_every_and_clean(root, capsys):
    code, out, _ = run(
        capsys,
        "prune",
        str(root),
        "--keep-every",
        "20",
        "--keep-best",
        "1",
        "--metric",
        "loss",
        "--mode",
        "max",
        "--layout",
        "global_step",
        "--clean-leftovers",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert data["deleted"] == [10, 30, 50]
    assert data["kept"]["60"] == [
        "newest",
        "tracker",
        "KeepBest(1, 'loss', mode='max')",
        "KeepEvery(20)",
    ]
    assert data["cleaned"] == [".tmp-global_step_70-dead"]


def test_clean_leftovers_is_refused_while_an_engine_holds_the_root(tmp_path, capsys):
    """A live engine's save in flight is a temporary, exactly like a crash's leftover:
    ``prune --clean-leftovers`` removed it and that save failed. The root's locks are looked
    at first: held, nothing is removed and the exit code says so."""
    from asyncckpt import SyncCheckpointEngine

    leftover = tmp_path / L.tmp_name("global_step", 70, "inflight")
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        engine.save(1, {"w": torch.zeros(4)}).committed_sync(60)
        leftover.mkdir()  # (as a save in flight holds it)
        code, out, err = run(
            capsys, "prune", str(tmp_path), "--keep-last", "1", "--clean-leftovers"
        )
        assert code == 1 and leftover.exists(), (out, err)
        assert "not removing leftovers: a live engine holds" in err and ".lock.rank0" in err
        code, out, _ = run(
            capsys, "prune", str(tmp_path), "--keep-last", "1", "--clean-leftovers", "--json"
        )
        assert code == 1 and json.loads(out)["clean_refused_live_locks"], out
    assert leftover.exists()
    code, out, _ = run(capsys, "prune", str(tmp_path), "--keep-last", "1", "--clean-leftovers")
    assert code == 0 and not leftover.exists(), out  # the engine is gone: a leftover now


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["prune", "ROOT"],  # no policy
        ["prune", "ROOT", "--keep-best", "1"],  # no metric
        ["prune", "ROOT", "--keep-last", "2", "--metric", "loss"],
        ["prune", "ROOT", "--keep-last", "-1"],
        ["prune", "ROOT", "--keep-last", "two"],
        ["prune", "ROOT", "--keep-every", "0"],
        ["ls", "ROOT", "--layout", "weird"],
    ],
)
def test_bad_usage_exits_2(root, capsys, argv):
    argv = [str(root) if a == "ROOT" else a for a in argv]
    before = set(os.listdir(root))
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert "usage" in err
    assert set(os.listdir(root)) == before


def test_errors_exit_1(root, tmp_path, capsys):
    (root / L.TRACKER).write_text("50")  # tracker lags the newest (60)
    code, _, err = run(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 1 and "refusing" in err
    assert len(L.scan(root, "global_step")) == 6
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--allow-tracker-lag")
    assert code == 0 and "deleted: 10, 20, 30, 40" in out
    code, _, err = run(capsys, "ls", str(tmp_path / "missing"))
    assert code == 1 and "no such directory" in err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "prune" in capsys.readouterr().out


def test_python_dash_m(root):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "prune", str(root), "--keep-last", "3", "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "would delete: 10, 20, 30" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "prune", str(root)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2


@pytest.mark.parametrize("as_json", [False, True])
def test_prune_racing_the_engines_own_prune_succeeds(root, capsys, monkeypatch, as_json):
    """The engine's worker prunes after each commit; a `prune` run beside it may find a step
    it planned to delete already gone (between its scan and its manifest read, or between its
    plan and the deletion). That is what was asked for: exit 0, and say so."""
    import shutil

    import asyncckpt.storage.local as local
    import asyncckpt.storage.prune as P

    real_delete, real_info = P.delete, local.read_checkpoint_info

    def engine_first(store, name):
        if name == "global_step_20":
            real_delete(store, name)  # the engine's prune, a moment earlier
        real_delete(store, name)

    def vanishing(path, step=None):
        if step == 10:  # pruned between the scan and the read of its manifest
            shutil.rmtree(path)
        return real_info(path, step)

    monkeypatch.setattr(P, "delete", engine_first)
    monkeypatch.setattr(local, "read_checkpoint_info", vanishing)
    argv = ["prune", str(root), "--keep-last", "2", *(["--json"] if as_json else [])]
    code, out, err = run(capsys, *argv)
    assert code == 0, (out, err)
    if as_json:
        data = json.loads(out)
        assert data["deleted"] == [30, 40] and data["already_gone"] == [20]
        assert data["errors"] == {}
    else:
        assert "deleted: 30, 40" in out
        assert "already gone (deleted meanwhile by another process, e.g. the engine): 20" in out
        assert "error" not in out
    assert {c.step for c in L.scan(root, "global_step")} == {50, 60}
    assert not [n for n in os.listdir(root) if n.startswith(L.TRASH_PREFIX)]


def _eventually(check, limit: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ls_shows_a_write_in_progress_by_its_worker_then_its_leftover(tmp_path, capsys):
    """A worker still writing (hung before its rename): `ls` lists the step as in progress,
    with the worker's pid; once that worker is killed, the same temporary is a leftover."""
    import signal
    import socket

    import torch

    from asyncckpt import SyncCheckpointEngine, faults

    state = {"w": torch.arange(1000.0)}
    # (write_timeout: a failed assertion must not leave the close waiting on the hung worker)
    with SyncCheckpointEngine(
        tmp_path, keep=None, throttle=ThrottleConfig.background(write_timeout=30)
    ) as engine:
        engine.save(1, state).committed_sync(60)
        faults.inject("before_rename", "hang")
        handle = engine.save(2, state)
        pid = engine.worker_pid
        _eventually(lambda: any(L.is_writer_note(n) for n in os.listdir(tmp_path)))
        code, out, _ = run(capsys, "ls", "--json", str(tmp_path))
        d = json.loads(out)
        (w,) = d["in_progress"]
        assert (w["step"], w["pid"], w["rank"], w["state"]) == (2, pid, 0, "in progress")
        assert w["host"] == socket.gethostname() and w["name"].startswith(L.TMP_PREFIX)
        assert d["leftovers"] == [] and d["uploads_pending"] is None
        code, out, _ = run(capsys, "ls", str(tmp_path))
        assert f"in progress: step 2 by pid {pid} on host" in out, out
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(Exception, match="died|write_timeout"):
            handle.committed_sync(60)
        code, out, _ = run(capsys, "ls", "--json", str(tmp_path))
        d = json.loads(out)
        assert d["in_progress"] == [] and d["leftovers"] == [w["name"]]
        code, out, _ = run(capsys, "ls", str(tmp_path))
        assert f"leftover: {w['name']} (its writer is gone; cleaned at the next start)" in out
        assert "in progress" not in out
