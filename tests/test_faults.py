"""Fault injection: the points and actions themselves, and what the engine does under them.

Disk full and I/O errors at every write point (injected, and a real full tmpfs), a hung worker
against ``write_timeout``, and the worker killed during and between saves. After each: the
handle fails with the cause, nothing partial is left, nothing is pruned, older checkpoints are
intact, and the next save works.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from asyncckpt import (
    KeepLast,
    SaveFailed,
    SyncCheckpointEngine,
    ThrottleConfig,
    WorkerDied,
    WriteTimeout,
    faults,
    verify,
)
from asyncckpt.core import layout as L
from asyncckpt.testing import parts


def _timeout(seconds: float) -> ThrottleConfig:
    return ThrottleConfig.background(write_timeout=seconds)


#: Points in the worker's write path, in order; an error at any of them fails the save.
WRITE_POINTS = (
    "before_shard_write",
    "mid_shard_write",
    "after_shard_write",
    "before_metadata",
    "before_rename",
    "before_tracker",
)


def state_at(step: int, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g)},
        "optim": {"m": torch.rand(n, generator=g, dtype=torch.float64)},
        "step": step,
    }


def assert_state(got: dict, step: int, n: int = 1000) -> None:
    want = state_at(step, n)
    for group in ("model", "optim"):
        for k, v in want[group].items():
            assert got[group][k].dtype == v.dtype and torch.equal(got[group][k], v), (group, k)
    assert got["step"] == step


def blank(n: int = 1000) -> dict:
    s = state_at(0, n)
    for group in ("model", "optim"):
        for t in s[group].values():
            t.zero_()
    s["step"] = -1
    return s


def assert_loads_latest(engine, step: int, n: int = 1000) -> None:
    """The engine's newest good checkpoint is ``step`` and restores exactly ``state_at(step)``."""
    got = blank(n)
    assert engine.load_latest(got) == step
    assert_state(got, step, n)


def leftovers(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if L.is_leftover(n))


def committed(root: Path) -> list[int]:
    return [c.step for c in L.scan(root, "global_step")]


def eventually(check, limit: float = 120.0) -> None:
    """Wait for ``check()`` (pruning runs after the commit, in the background)."""
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def wait_failed(handle, timeout: float = 120.0) -> BaseException:
    with pytest.raises(SaveFailed) as info:
        handle.committed_sync(timeout)
    return info.value


# ------------------------------------------------------------------------------ the module


def test_parse_spec_and_env_syntax():
    spec = faults.parse_spec("before_rename=kill; mid_shard_write=eio@2,mid_prune=delay:0.25")
    assert spec["before_rename"].action == "kill" and spec["before_rename"].after == 0
    assert spec["mid_shard_write"].action == "eio" and spec["mid_shard_write"].after == 2
    assert spec["mid_prune"].action == "delay" and spec["mid_prune"].seconds == 0.25
    assert faults.parse_spec("") == {}
    for bad in ("nowhere=kill", "before_rename=explode", "before_rename"):
        with pytest.raises(ValueError):
            faults.parse_spec(bad)


def test_a_thread_armed_for_one_job_fires_only_that_jobs_faults():
    """``armed_for``: an upload thread works for one save; a point armed for a later save
    neither fires there nor counts a hit, and fires where it was armed."""
    faults.inject("after_commit", "raise", after=1)
    snap = faults.snapshot()
    try:
        with faults.armed_for({}):  # a save made before the fault was armed
            for _ in range(3):
                faults.point("after_commit")  # not a hit: after=1 still holds below
        with faults.armed_for(snap):
            faults.point("after_commit")  # the first hit
            with pytest.raises(RuntimeError, match="after_commit"):
                faults.point("after_commit")
        faults.inject("mid_prune", "raise")
        with pytest.raises(RuntimeError, match="mid_prune"):
            faults.point("mid_prune")  # no scope (the main loop): every armed fault
    finally:
        faults.clear()


def test_inject_validates():
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.inject("before_lunch", "kill")
    with pytest.raises(ValueError, match="unknown fault action"):
        faults.inject("before_rename", "explode")
    with pytest.raises(ValueError):
        faults.inject("before_rename", "eio", after=-1)


def test_points_cover_every_pipeline_boundary():
    for p in (
        "after_stage",
        "before_shard_write",
        "mid_shard_write",
        "after_shard_write",
        "before_metadata",
        "before_rename",
        "before_tracker",
        "after_commit",
        "mid_prune",
    ):
        assert p in faults.POINTS


@pytest.mark.parametrize(
    "action, exc, code",
    [("enospc", OSError, errno.ENOSPC), ("eio", OSError, errno.EIO), ("raise", RuntimeError, None)],
)
def test_actions_raise_and_fire_once_after_k_hits(action, exc, code):
    faults.inject("before_metadata", action, after=2)
    faults.point("before_metadata")
    faults.point("before_metadata")
    with pytest.raises(exc) as info:
        faults.point("before_metadata")
    if code is not None:
        assert info.value.errno == code
    faults.point("before_metadata")  # fired once: disarmed


def test_delay_stays_armed_and_clear_disarms():
    faults.inject("mid_prune", "delay:0.05")
    t0 = time.perf_counter()
    faults.point("mid_prune")
    faults.point("mid_prune")
    assert time.perf_counter() - t0 >= 0.1
    faults.clear("mid_prune")
    t0 = time.perf_counter()
    faults.point("mid_prune")
    assert faults.snapshot() == {}


def test_snapshot_install_consume_fire_once_across_processes():
    # The trainer arms a point; the "worker" (here: the same module, after install) fires it
    # and reports; the trainer disarms it, and a fresh worker never sees it again.
    faults.inject("before_rename", "eio", after=1)
    snap = faults.snapshot()
    ((fid,),) = [(v[3],) for v in snap.values()]
    reported = []
    faults.clear()
    faults.set_reporter(reported.append)
    try:
        faults.install(snap)
        faults.point("before_rename")  # hit 1: skipped
        faults.install(snap)  # the next job: keeps its own hit count
        with pytest.raises(OSError):
            faults.point("before_rename")
        assert reported == [fid]
        faults.install(snap)  # the trainer has not heard yet: not re-armed
        faults.point("before_rename")
        faults.install({})  # the trainer cleared its faults: the worker drops them too
    finally:
        faults.set_reporter(None)
    faults.clear()
    faults.install(snap)
    faults.consume(fid)  # the trainer side
    faults.inject("before_rename", "eio")
    new = faults.snapshot()
    faults.consume(fid)  # an old id does not disarm a new injection
    assert faults.snapshot() == new


def test_env_var_arms_points_in_a_subprocess():
    code = "from asyncckpt import faults; print(sorted(faults.snapshot().items()))"
    env = dict(os.environ, ASYNCCKPT_FAULTS="before_rename=kill;mid_shard_write=eio@2")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "('before_rename', ('kill', 0, 0.0," in out.stdout
    assert "('mid_shard_write', ('eio', 2, 0.0," in out.stdout


def test_env_var_kill_crashes_a_training_script(tmp_path):
    """The testing aid as a user would use it: crash a script at a point, then resume."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "from asyncckpt import SyncCheckpointEngine\n"
        "with SyncCheckpointEngine(sys.argv[1]) as e:\n"
        "    for step in range(1, 4):\n"
        "        e.save(step, {'w': torch.full((8,), float(step))}).committed_sync()\n"
        "        print('committed', step, flush=True)\n"
    )
    root = tmp_path / "ckpts"
    env = dict(os.environ, ASYNCCKPT_FAULTS="after_stage=kill@1")  # the 2nd save's staging
    out = subprocess.run(
        [sys.executable, str(script), str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert out.stdout.split() == ["committed", "1"]
    time.sleep(0.5)
    with SyncCheckpointEngine(root) as engine:  # waits for the orphaned worker, cleans up
        target = {"w": torch.zeros(8)}
        assert engine.load_latest(target) == 1
        assert torch.equal(target["w"], torch.full((8,), 1.0))
        assert leftovers(root) == []


# ------------------------------------------------------------------------------ every point


def test_every_point_is_reached(tmp_path):
    """Each named point is on the path of a save with pruning: arm it, see it fire."""
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        engine.save(0, state_at(0)).committed_sync()
        step = 1
        for point in WRITE_POINTS:
            faults.inject(point, "raise")
            err = wait_failed(engine.save(step, state_at(step)))
            assert f"fault injected at {point}" in str(err.__cause__), point
            assert committed(tmp_path) == [0]
            step += 1
        faults.inject("after_stage", "raise")  # in the trainer: save itself raises
        with pytest.raises(RuntimeError, match="after_stage"):
            engine.save(step, state_at(step))
        engine.save(step, state_at(step)).committed_sync()  # and the same step again works
        eventually(lambda: committed(tmp_path) == [step])
        # after_commit and mid_prune are after the commit: a kill there loses nothing.
        for point in ("after_commit", "mid_prune"):
            step += 1
            pid = engine.worker_pid
            faults.inject(point, "kill")
            engine.save(step, state_at(step)).committed_sync()
            deadline = time.monotonic() + 120
            while engine.worker_restarts == 0 or engine.worker_pid == pid:
                assert time.monotonic() < deadline, f"{point} did not kill the worker"
                time.sleep(0.02)
            assert L.read_tracker(tmp_path) == step
            if point == "mid_prune":
                assert any(n.startswith(L.TRASH_PREFIX) for n in os.listdir(tmp_path))
            parts(engine).supervisor.restarts = 0
        step += 1
        engine.save(step, state_at(step)).committed_sync()
    with SyncCheckpointEngine(tmp_path) as engine:
        assert leftovers(tmp_path) == []
        assert_loads_latest(engine, step)


# ------------------------------------------------------------------------------ ENOSPC / EIO


@pytest.mark.parametrize("action, code", [("enospc", errno.ENOSPC), ("eio", errno.EIO)])
def test_errors_at_every_write_point(tmp_path, action, code):
    root = tmp_path
    with SyncCheckpointEngine(root, keep=KeepLast(2)) as engine:
        for s in (1, 2):
            engine.save(s, state_at(s)).committed_sync()
        before = {c.step: c.path.stat().st_mtime_ns for c in L.scan(root, "global_step")}
        step = 3
        for point in WRITE_POINTS:
            faults.inject(point, action)
            err = wait_failed(engine.save(step, state_at(step)))
            cause = err.__cause__
            assert isinstance(cause, OSError) and cause.errno == code, (point, repr(cause))
            assert point in str(cause)
            # the partial directory is gone, nothing was pruned, the old ones are intact
            assert leftovers(root) == [], point
            assert committed(root) == [1, 2], point
            assert L.read_tracker(root) == 2
            rep = verify(root)
            assert rep.ok and [c.step for c in rep.checkpoints] == [1, 2]
            assert {
                c.step: c.path.stat().st_mtime_ns for c in L.scan(root, "global_step")
            } == before
        # training goes on: the next save succeeds (and prunes as usual)
        engine.save(step, state_at(step)).committed_sync()
        eventually(lambda: committed(root) == [2, 3])
    with SyncCheckpointEngine(root) as engine:
        assert_loads_latest(engine, 3)


def test_an_error_in_any_writer_thread_fails_the_save(tmp_path):
    """DCP writes files in several threads; an error in any of them must fail the save
    (DCP itself drops the exceptions of its extra threads)."""
    state = {f"t{i}": torch.randn(5000) for i in range(6)}
    with SyncCheckpointEngine(tmp_path) as engine:
        failed = 0
        for after in range(4):  # the 1st, 2nd, ... file written
            faults.inject("mid_shard_write", "eio", after=after)
            handle = engine.save(after, state)
            try:
                handle.committed_sync(120)
            except SaveFailed as e:
                failed += 1
                assert isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.EIO
                assert committed(tmp_path) == [] and leftovers(tmp_path) == []
            else:  # fewer files than `after`: then it must be complete and loadable
                assert after > 0
                break
        assert failed >= 2  # at least two shard files, plus DCP's .metadata
        faults.clear()
        engine.save(10, state).committed_sync()
    target = {k: torch.zeros(5000) for k in state}
    assert SyncCheckpointEngine(tmp_path).load_latest(target) == 10
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert verify(tmp_path).ok


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 20 MiB tmpfs (needs root and mount(2)); skipped cleanly where it cannot be mounted."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount/umount not available")
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_real_disk_full_on_a_small_filesystem(small_tmpfs):
    root = small_tmpfs / "ckpts"
    n = 400_000  # ~4.8 MB per checkpoint (float32 + float64)
    ballast = small_tmpfs / "ballast"
    with SyncCheckpointEngine(root, keep=KeepLast(2)) as engine:
        for s in (1, 2):
            engine.save(s, state_at(s, n)).committed_sync()
        # Fill the disk but ~1 MB: the next checkpoint cannot fit.
        free = shutil.disk_usage(small_tmpfs).free
        with open(ballast, "wb") as f:
            f.write(b"\0" * max(free - (1 << 20), 0))
        err = wait_failed(engine.save(3, state_at(3, n)))
        assert isinstance(err.__cause__, OSError), repr(err.__cause__)
        assert err.__cause__.errno == errno.ENOSPC
        assert leftovers(root) == [] and committed(root) == [1, 2]
        assert L.read_tracker(root) == 2 and verify(root).ok
        # Training goes on; once there is space again the next save succeeds.
        ballast.unlink()
        engine.save(3, state_at(3, n)).committed_sync()
        eventually(lambda: committed(root) == [2, 3])
    with SyncCheckpointEngine(root) as engine:
        assert_loads_latest(engine, 3, n)


# ------------------------------------------------------------------------------ hangs


def test_a_hung_write_fails_with_write_timeout_and_the_next_save_works(tmp_path):
    points = ("before_shard_write", "mid_shard_write", "before_rename")
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(2), throttle=_timeout(2.0)) as engine:
        engine.save(1, state_at(1)).committed_sync()
        for i, point in enumerate(points, start=2):
            faults.inject(point, "hang")
            err = wait_failed(engine.save(i, state_at(i)))
            assert isinstance(err, WriteTimeout) and "write_timeout" in str(err), point
            assert committed(tmp_path)[-1] == i - 1
            engine.save(i, state_at(i)).committed_sync()
        assert engine.worker_restarts == len(points)
    eventually(lambda: committed(tmp_path) == [3, 4])
    with SyncCheckpointEngine(tmp_path) as engine:  # the killed workers' temporaries: removed
        assert leftovers(tmp_path) == []
        assert_loads_latest(engine, 4)


def test_a_worker_hung_outside_a_write_is_caught_too(tmp_path):
    """Hung while pruning (after a commit): the next save must not wait forever."""
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1), throttle=_timeout(2.0)) as engine:
        engine.save(1, state_at(1)).committed_sync()
        faults.inject("mid_prune", "hang")
        engine.save(2, state_at(2)).committed_sync()  # committed; its prune hangs
        err = wait_failed(engine.save(3, state_at(3)))
        assert isinstance(err, WriteTimeout)
        engine.save(3, state_at(3)).committed_sync()
    with SyncCheckpointEngine(tmp_path) as engine:
        assert leftovers(tmp_path) == []  # the half-pruned step 1 (trash) was removed
        assert_loads_latest(engine, 3)


# ------------------------------------------------------------------------------ worker death


def test_worker_killed_during_a_save(tmp_path):
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(2)) as engine:
        for s in (1, 2):
            engine.save(s, state_at(s)).committed_sync()
        step = 3
        for point in ("before_shard_write", "before_metadata", "before_tracker"):
            faults.inject(point, "hang")
            handle = engine.save(step, state_at(step))
            pid = engine.worker_pid
            final = tmp_path / L.dir_name("global_step", step)
            # wait until the worker is inside the save (a temporary exists, or is renamed)
            eventually(
                lambda f=final: (
                    any(n.startswith(L.TMP_PREFIX + f.name) for n in os.listdir(tmp_path))
                    or f.exists()
                )
            )
            time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
            if point == "before_tracker":
                # Killed after the rename: committed, and the handle says so; the trainer
                # wrote the tracker the worker did not get to.
                handle.committed_sync(120)
                assert final.exists() and L.read_tracker(tmp_path) == step
                step += 1
            else:
                err = wait_failed(handle)
                assert isinstance(err, WorkerDied) and "died" in str(err)
                assert not final.exists()
                # the tracker still names the old newest
                assert L.read_tracker(tmp_path) == step - 1
            eventually(lambda p=pid: engine.worker_pid != p)  # a replacement starts
            assert all(c.ok for c in verify(tmp_path).checkpoints)
            engine.save(step, state_at(step)).committed_sync()
            assert L.read_tracker(tmp_path) == step
            step += 1
    newest = step - 1
    with SyncCheckpointEngine(tmp_path) as engine:
        assert leftovers(tmp_path) == []
        assert_loads_latest(engine, newest)
    assert verify(tmp_path).ok


def test_worker_killed_between_saves(tmp_path):
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(2)) as engine:
        engine.save(1, state_at(1)).committed_sync()
        for s in (2, 3):
            pid = engine.worker_pid
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while engine.worker_pid == pid:  # the reader notices and starts a new worker
                assert time.monotonic() < deadline
                time.sleep(0.01)
            engine.save(s, state_at(s)).committed_sync()  # nothing in flight was lost
        assert engine.worker_restarts == 2
        eventually(lambda: committed(tmp_path) == [2, 3])
    with SyncCheckpointEngine(tmp_path) as engine:
        assert_loads_latest(engine, 3)


def test_a_kill_fault_at_a_worker_point_fires_once(tmp_path):
    """A worker killed by a fault is replaced, and the replacement does not die of it too."""
    with SyncCheckpointEngine(tmp_path) as engine:
        faults.inject("before_rename", "kill")
        err = wait_failed(engine.save(1, state_at(1)))
        assert isinstance(err, WorkerDied)
        engine.save(1, state_at(1)).committed_sync()
        engine.save(2, state_at(2)).committed_sync()
        assert engine.worker_restarts == 1
    assert committed(tmp_path) == [1, 2]


@pytest.mark.parametrize("fail_in", ["write", "fsync"])
def test_enospc_writing_the_tracker_leaves_no_temporary(tmp_path, monkeypatch, fail_in):
    """A full disk while the tracker's temporary is written (or fsynced): the error reaches
    the caller, the old tracker stands, and the temporary is gone at once (not at the next
    start)."""
    from asyncckpt.storage import commit

    commit.write_tracker(tmp_path, "global_step", 1)
    (tmp_path / "global_step_2").mkdir()

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            if fail_in == "write":
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    from asyncckpt.storage import localfs  # (where the tracker's file is written)

    real_open = open
    monkeypatch.setattr(localfs, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
    if fail_in == "fsync":

        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(localfs.os, "fsync", full)
    with pytest.raises(OSError) as info:
        commit.write_tracker(tmp_path, "global_step", 2)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert L.read_tracker(tmp_path) == 1
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["global_step_2", *L.tracker_names("global_step")]
    )
