"""A stand-in (the process a surviving worker starts to write a dead rank's files) ends with
the worker that started it.

It holds that rank's worker lock while it writes; when its worker was SIGKILLed mid-write it
lived on for minutes, and a new trainer of that rank waited on the lock all that time. Driven
here through the real entry (``python -m asyncckpt.worker.stand_in``, started by
``replication.spawn_stand_in`` from a parent process standing for the worker), its write held
just after its files (a fault point's delay), as a large write would be.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncckpt import SyncCheckpointEngine
from asyncckpt.core import layout as L
from asyncckpt.storage.local import LocalStore

REPO = Path(__file__).resolve().parents[2]

#: The surviving worker: starts a stand-in for rank 0 whose write of step 5 stops just after
#: its files are written, says the stand-in's pid, and waits for it (as the worker does).
PARENT = """
import io, os, sys, torch
from asyncckpt import faults
from asyncckpt.memory import replication as R
from asyncckpt.worker.loop import SaveJob, WorkerConfig

root, wait, deadline = sys.argv[1], sys.argv[2], float(sys.argv[3])
buf = R.SharedBuffer(64)
faults.inject("after_shard_write", "delay:600")
raw = io.BytesIO()
torch.save({"step": 5}, raw)
job = SaveJob(job_id=1, step=5, arena_ids=[7], specs=[], objects={"extra": raw.getvalue()},
              paths={}, metrics={}, faults=faults.snapshot(), tier="memory")
config = WorkerConfig(root=root, layout="global_step", fmt="dcp", rank=0,
                      orphan_deadline_s=deadline)
proc = R.spawn_stand_in(R.STAND_IN_MODULE, config, [job], {7: buf})
print(proc.pid, flush=True)
if wait == "wait":
    print(proc.wait(), flush=True)
else:  # gone at once, before the stand-in runs a line of its own
    os._exit(0)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet has ended: not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_until(what, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.1)
    return what()


def _start(root: Path, wait: str = "wait", deadline: float = 600) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(root), wait, str(deadline)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line.strip(), parent.wait(60)
    return parent, int(line)


def _lock_free(root: Path, holder: str) -> bool:
    fd = LocalStore(root).lock(holder, wait=False)
    if fd is None:
        return False
    os.close(fd)
    return True


def _temporaries(root: Path) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith(L.TMP_PREFIX) and "writer" not in n]


def test_a_stand_in_ends_with_its_parent_and_leaves_only_a_temporary(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    parent, stand_in = _start(root)
    try:
        # Its files are written, the step is not committed, the rank's worker lock is held.
        assert _wait_until(lambda: _temporaries(root) and not _lock_free(root, "worker0"), 300)
        assert _alive(stand_in)
        parent.send_signal(signal.SIGKILL)
        parent.wait(60)
        assert _wait_until(lambda: not _alive(stand_in), 10.0), "the stand-in outlived its parent"
        assert _lock_free(root, "worker0")
    finally:
        if _alive(stand_in):
            os.kill(stand_in, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
    # Half-written: a temporary, never a commit; the next start of that rank removes it.
    assert L.scan(root, "global_step") == [] and not (root / L.TRACKER).exists()
    assert _temporaries(root)
    with SyncCheckpointEngine(root, keep=None):
        assert _temporaries(root) == [], os.listdir(root)


def test_a_stand_in_whose_parent_is_gone_before_it_starts_exits_at_once(tmp_path):
    """The parent may die before the stand-in runs its first line: its parent is then init
    already, and it exits without taking the lock (adopted by a subreaper instead: the test
    below)."""
    root = tmp_path / "root"
    root.mkdir()
    parent, stand_in = _start(root, wait="exit", deadline=30)
    try:
        parent.wait(60)
        assert _wait_until(lambda: not _alive(stand_in), 60.0), "the stand-in outlived its parent"
        assert _lock_free(root, "worker0")
        assert L.scan(root, "global_step") == []
    finally:
        if _alive(stand_in):
            os.kill(stand_in, signal.SIGKILL)


def test_a_stand_in_never_outlives_its_deadline(tmp_path):
    """Its parent worker ends itself ``write_timeout`` after the trainers' death (before the
    stand-in started): a stand-in past that bound exits too, parent or not."""
    root = tmp_path / "root"
    root.mkdir()
    parent, stand_in = _start(root, wait="wait", deadline=20)
    try:
        out, _ = parent.communicate(timeout=120)  # (it waits for the stand-in)
        assert out.strip() == "3"  # the stand-in's exit status
        assert _lock_free(root, "worker0") and L.scan(root, "global_step") == []
    finally:
        if _alive(stand_in):
            os.kill(stand_in, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


#: A subreaper (as a container's init or systemd --user is): it starts PARENT, which starts a
#: stand-in and exits at once, so the orphaned stand-in is adopted by this process, not init.
SUBREAPER = """
import ctypes, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
parent = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], "exit", "600"],
                          stdout=subprocess.PIPE, text=True)
print(parent.stdout.readline().strip(), flush=True)
parent.wait()
while True:  # reaps what it adopted, as a subreaper does
    try:
        import os
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.1)
"""


def test_a_stand_in_adopted_by_a_subreaper_still_sees_its_worker_gone(tmp_path):
    """The worker names itself in the stand-in's environment: a stand-in whose worker died
    before its first line, adopted by a subreaper (not init), exits at once instead of at
    its deadline (600 s here)."""
    root = tmp_path / "root"
    root.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    reaper = subprocess.Popen(
        [sys.executable, "-c", SUBREAPER, PARENT, str(root)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert reaper.stdout is not None
    stand_in = int(reaper.stdout.readline())
    try:
        assert _wait_until(lambda: not _alive(stand_in), 60.0), "the stand-in outlived its parent"
        assert _lock_free(root, "worker0")
        assert L.scan(root, "global_step") == []
    finally:
        if _alive(stand_in):
            os.kill(stand_in, signal.SIGKILL)
        reaper.kill()
        reaper.wait(60)
