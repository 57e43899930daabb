"""The save path and the worker's lifecycle (issue 11: items 5, 6, 7, 9).

Steps never move the tracker backwards; old staging arenas are freed in the worker too when the
state's layout changes; a signal during a worker restart never hangs the process; a worker
killed after the commit rename reports the commit, not a failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncckpt import CheckpointError, Retention, SyncCheckpointEngine, WorkerDied, faults
from asyncckpt.core import layout as L
from asyncckpt.storage import commit as C
from asyncckpt.testing import parts


def state_at(step: int, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g)}, "step": step}


def assert_loads(engine, step: int) -> None:
    got = {"model": {"w": torch.zeros(1000)}, "step": -1}
    assert engine.load_latest(got) == step
    assert torch.equal(got["model"]["w"], state_at(step)["model"]["w"]) and got["step"] == step


def names(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def committed(root: Path) -> list[int]:
    return [c.step for c in L.scan(root, "global_step")]


# ------------------------------------------------------------------------------ item 5


def test_a_save_older_than_the_newest_committed_or_in_flight_step_is_refused(tmp_path):
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(30, state_at(30)).committed_sync(120)
        before = names(tmp_path)
        with pytest.raises(CheckpointError, match=r"step 5\b.*step 30\b"):
            engine.save(5, state_at(5))
        assert names(tmp_path) == before  # nothing written, not even a temporary
        assert L.read_tracker(tmp_path) == 30 and engine.latest_step() == 30
        # In flight counts too: lower than (or equal to) a step still being written.
        faults.inject("before_shard_write", "delay:1.0")
        h = engine.save(40, state_at(40))
        with pytest.raises(CheckpointError, match=r"step 35\b.*step 40\b"):
            engine.save(35, state_at(35))
        with pytest.raises(CheckpointError, match="step 40"):
            engine.save(40, state_at(40))
        h.committed_sync(120)
        faults.clear()
        engine.save(41, state_at(41)).committed_sync(120)
    assert committed(tmp_path) == [30, 40, 41] and L.read_tracker(tmp_path) == 41


def test_allow_older_steps_commits_it_but_the_tracker_never_moves_back(tmp_path):
    with SyncCheckpointEngine(tmp_path, retention=Retention(allow_older_steps=True)) as engine:
        engine.save(30, state_at(30)).committed_sync(120)
        stats = engine.save(5, state_at(5)).committed_sync(120)
        assert Path(stats.path).name == "global_step_5"
        assert committed(tmp_path) == [5, 30]
        assert L.read_tracker(tmp_path) == 30 and engine.latest_step() == 30
        assert (tmp_path / L.SKYRL_TRACKER).read_text().strip() == "30"
        got = {"model": {"w": torch.zeros(1000)}, "step": -1}
        assert engine.load(got, step=5) == 5 and got["step"] == 5
        engine.save(31, state_at(31)).committed_sync(120)
        assert L.read_tracker(tmp_path) == 31


def test_write_tracker_only_moves_forward(tmp_path):
    for s in (3, 9):
        (tmp_path / L.dir_name("global_step", s)).mkdir()
    assert C.write_tracker(tmp_path, "global_step", 9)
    assert not C.write_tracker(tmp_path, "global_step", 3)
    assert L.read_tracker(tmp_path) == 9
    assert (tmp_path / L.SKYRL_TRACKER).read_text().strip() == "9"
    assert C.write_tracker(tmp_path, "global_step", 9)  # the same step: rewritten, harmless
    # A tracker naming a step that is not there (deleted by hand) protects nothing: repaired.
    C.write_tracker(tmp_path, "global_step", 50)
    assert C.write_tracker(tmp_path, "global_step", 3) and L.read_tracker(tmp_path) == 3


def test_the_tracker_never_moves_back_past_a_step_listed_under_another_spelling(tmp_path):
    """``global_step_0100`` is listed as step 100 (a scan parses the number), but only
    ``global_step_100`` held the tracker: an older step's commit moved it from 100 to 50
    while step 100 was committed, and every prune then refused (the tracker lags)."""
    odd = tmp_path / "global_step_0100"
    odd.mkdir()
    (odd / L.DCP_METADATA).write_bytes(b"")  # (listed as a checkpoint written elsewhere)
    assert C.write_tracker(tmp_path, "global_step", 100)
    assert not C.write_tracker(tmp_path, "global_step", 50)
    assert L.read_tracker(tmp_path) == 100


# ------------------------------------------------------------------------------ item 6


def _shm_mapped(pid: int) -> int:
    """Bytes of torch shared-memory files mapped into ``pid`` (the staging arenas)."""
    total = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/shm/torch_"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                total += hi - lo
    return total


def test_the_worker_frees_old_arenas_when_the_layout_changes(tmp_path):
    mib = 1 << 20
    size = 64 * mib
    base = _shm_mapped(os.getpid())  # (whatever earlier tests in this process left)
    with SyncCheckpointEngine(tmp_path) as engine:
        pid = engine.worker_pid
        for i in range(6):  # every save a new layout (a new key), like AdamW's first step
            state = {"w": torch.zeros(size // 4), f"extra{i}": torch.full((3,), float(i))}
            if i % 2:
                engine.prepare(state)  # prepare hands arenas to the worker too
            engine.save(i, state).committed_sync(120)
            assert _shm_mapped(os.getpid()) - base < size + 16 * mib
        assert engine.worker_pid == pid
        # The worker drops its mappings when it reads the drop messages, just after the save.
        deadline = time.monotonic() + 30
        while _shm_mapped(pid) >= size + 16 * mib and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _shm_mapped(pid) < size + 16 * mib, _shm_mapped(pid) / mib
        got = {"w": torch.ones(size // 4), "extra5": torch.zeros(3)}
        assert engine.load_latest(got) == 5 and got["extra5"][0] == 5 and not got["w"].any()


# ------------------------------------------------------------------------------ item 7

_SIGNAL_SCRIPT = """
import os, signal, sys, threading, time, torch
import anyio
from asyncckpt import CheckpointEngine, SyncCheckpointEngine, WorkerDied, faults

root, sig, mode = sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3]
# Ctrl-C as in a terminal: a process started with SIGINT ignored (a pytest-xdist worker's
# children inherit that) never raises KeyboardInterrupt, and the save would just go on.
signal.signal(signal.SIGINT, signal.default_int_handler)
state = {"w": torch.ones(1000)}

def later(engine):
    # Fired while save(2) waits for the replacement of the worker that the fault killed.
    def fire():
        time.sleep(0.3)
        print("ready-when-signalled", engine.worker_ready, flush=True)
        os.kill(os.getpid(), sig)
    threading.Thread(target=fire, daemon=True).start()

def sync_main():
    with SyncCheckpointEngine(root) as engine:
        faults.inject("before_shard_write", "kill")
        try:
            engine.save(1, state).committed_sync(120)
        except WorkerDied:
            print("step 1 failed", flush=True)
        later(engine)
        try:
            h = engine.save(2, state)
            print("save 2 returned", flush=True)
        except KeyboardInterrupt:
            print("save 2 interrupted", flush=True)
            raise

async def async_main():
    async with CheckpointEngine(root) as engine:
        faults.inject("before_shard_write", "kill")
        try:
            await (await engine.save(1, state)).committed()
        except WorkerDied:
            print("step 1 failed", flush=True)
        later(engine)
        await engine.save(2, state)
        print("save 2 returned", flush=True)
        await anyio.sleep(30)

if mode == "sync":
    sync_main()
else:
    anyio.run(async_main)
print("exited", flush=True)
"""


@pytest.mark.parametrize(
    "sig, mode",
    [("SIGTERM", "sync"), ("SIGINT", "sync"), ("SIGTERM", "async")],
)
def test_a_signal_while_a_save_waits_for_a_restarted_worker_never_hangs(tmp_path, sig, mode):
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-c", _SIGNAL_SCRIPT, str(tmp_path), sig, mode],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process hung after {sig}: {e.stdout!r} {e.stderr!r}")
    elapsed = time.monotonic() - t0
    assert "step 1 failed" in out.stdout, out.stderr
    assert "ready-when-signalled False" in out.stdout, out.stdout  # the scenario happened
    assert elapsed < 30, elapsed
    if sig == "SIGTERM":
        # Preemption: the staged save is handed to the new worker and committed, then the
        # process stops as SIGTERM would have stopped it.
        assert out.returncode == -signal.SIGTERM, out.stderr
        assert committed(tmp_path) == [2] and L.read_tracker(tmp_path) == 2
    else:
        # Ctrl-C interrupts the save itself: reported (KeyboardInterrupt), nothing in flight.
        assert "save 2 interrupted" in out.stdout, out.stderr
        assert out.returncode != 0 and "KeyboardInterrupt" in out.stderr
        assert committed(tmp_path) == []


# ------------------------------------------------------------------------------ item 9


def test_a_worker_killed_after_the_rename_reports_the_commit(tmp_path):
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state_at(1)).committed_sync(120)
        faults.inject("before_tracker", "kill")
        stats = engine.save(2, state_at(2)).committed_sync(120)
        assert Path(stats.path) == tmp_path / "global_step_2"
        assert L.read_tracker(tmp_path) == 2 and engine.latest_step() == 2
        assert (tmp_path / L.SKYRL_TRACKER).read_text().strip() == "2"
        # It is committed, truthfully: a second save of it is refused.
        with pytest.raises(CheckpointError, match="already committed"):
            engine.save(2, state_at(2))
        assert_loads(engine, 2)
        engine.save(3, state_at(3)).committed_sync(120)  # on the replacement worker
        assert engine.worker_restarts == 1 and L.read_tracker(tmp_path) == 3


def test_a_worker_killed_before_the_rename_fails_and_the_step_can_be_saved_again(tmp_path):
    with SyncCheckpointEngine(tmp_path) as engine:
        jobs = parts(engine).jobs
        fail, restarts_seen = jobs.fail, []

        def recording_fail(job_id, err):  # what a caller woken by this failure would read
            restarts_seen.append(engine.worker_restarts)
            fail(job_id, err)

        jobs.fail = recording_fail
        faults.inject("before_rename", "kill")
        with pytest.raises(WorkerDied, match="nothing was committed"):
            engine.save(1, state_at(1)).committed_sync(120)
        # The death is counted before any handle fails (torture trials read the count then).
        assert restarts_seen == [1]
        assert committed(tmp_path) == [] and L.read_tracker(tmp_path) is None
        engine.save(1, state_at(1)).committed_sync(120)
        assert L.read_tracker(tmp_path) == 1
        assert_loads(engine, 1)


def test_a_job_handed_to_nobody_is_not_left_in_flight(tmp_path):
    """A save whose hand-off to the worker raised (interrupted) must not be waited for."""
    engine = SyncCheckpointEngine(tmp_path)
    engine.__enter__()
    core = parts(engine)
    try:
        real = core.supervisor.wait_ready

        def interrupted() -> None:
            raise KeyboardInterrupt

        core.supervisor.wait_ready = interrupted
        with pytest.raises(KeyboardInterrupt):
            engine.save(1, state_at(1))
        core.supervisor.wait_ready = real
        core.drain(timeout=5)  # nothing left in flight: close() would not wait for it
        assert all(o is None for o in core.jobs.slot_owner.values())
        engine.save(1, state_at(1)).committed_sync(120)
    finally:
        core.stop(drain=False)
    assert committed(tmp_path) == [1]


def test_a_script_that_never_closes_its_engine_still_exits(tmp_path):
    """multiprocessing's exit hook joins the worker, which waits on its pipe: without our own
    hook first (drain, then stop), the interpreter never exits."""
    script = (
        "import sys, torch\n"
        "from asyncckpt import SyncCheckpointEngine, faults\n"
        "faults.inject('before_shard_write', 'delay:0.5')\n"
        "engine = SyncCheckpointEngine(sys.argv[1])\n"
        "engine.__enter__()\n"
        "engine.save(1, {'w': torch.ones(3)})\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)], capture_output=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the interpreter hung at exit")
    assert out.returncode == 0, out.stderr
    assert committed(tmp_path) == [1] and L.read_tracker(tmp_path) == 1  # staged: committed


@pytest.mark.integration
def test_two_ranks_whose_rank0_worker_dies_after_the_rename_both_report_the_commit(tmp_path):
    from test_multirank import run_ranks, save_steps

    root = tmp_path / "ckpt"
    out = run_ranks(save_steps, 2, tmp_path, str(root), [1, 2], 0, "kill", "before_tracker")
    for rank in range(2):
        assert out[rank][2] == "committed", out  # rank 1's worker saw only a broken group
        assert out[rank][3] == "committed"
    assert out[0]["tracker_after_failure"] == 2  # rank 0's trainer wrote it
    assert committed(root) == [2, 3] and L.read_tracker(root) == 3


def test_sigterm_during_close_still_commits_the_staged_save(tmp_path):
    script = (
        "import os, signal, sys, threading, time, torch\n"
        "from asyncckpt import SyncCheckpointEngine, faults\n"
        "faults.inject('before_shard_write', 'delay:2')\n"
        "engine = SyncCheckpointEngine(sys.argv[1])\n"
        "engine.__enter__()\n"
        "engine.save(1, {'w': torch.ones(3)})\n"
        "def fire():\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "threading.Thread(target=fire).start()\n"
        "engine.close()  # draining when SIGTERM arrives\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, timeout=60
    )
    assert out.returncode == -signal.SIGTERM, out.stderr
    assert committed(tmp_path) == [1] and L.read_tracker(tmp_path) == 1


def test_only_ascii_digits_name_a_step(tmp_path):
    """A tracker holding "²" (a digit to ``str.isdigit``, no number to ``int``) crashed every
    reader of it with ValueError; a directory named with another script's digits
    ("global_step_\u0663", read by ``int`` as 3) was a second name of step 3."""
    (tmp_path / L.TRACKER).write_text("\u00b2\n")
    assert L.read_tracker(tmp_path) is None
    for layout, name in (("global_step", "global_step_\u0663"), ("megatron", "iter_\u0663" * 7)):
        assert L.parse_dir_name(layout, name) is None
    assert L.parse_dir_name("global_step", "global_step_3") == 3
