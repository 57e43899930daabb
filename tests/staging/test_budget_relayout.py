"""``Staging(max_host_bytes=)`` when the state's layout changes: the host never holds the
old layout's staging buffers beside the new one's. Both processes map a buffer (shared
memory), so its memory comes back only once the worker lets go too: before, the worker
dropped the old buffers when the next save was handed over, after its whole copy, and for
that while the host held both (a 40 MiB budget, a 30 MiB state, then another 30 MiB layout:
60 MiB).

Measured from the processes' mappings (``/proc/<pid>/maps``: the staging buffers are torch's
shared-memory files), not from ``/dev/shm``'s usage, which other tests running beside this
one move."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import torch
from statecmp import assert_same

from asyncckpt import Staging, SyncCheckpointEngine, faults

MiB = 1 << 20
_SHM = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ (\d+)\s+/dev/shm/torch_")


def staging_bytes(pids: list[int]) -> int:
    """The bytes of torch shared-memory files mapped by any of ``pids`` (each file once)."""
    sizes: dict[int, int] = {}
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            m = _SHM.match(line)
            if m:
                inode = int(m.group(3))
                sizes[inode] = max(sizes.get(inode, 0), int(m.group(2), 16) - int(m.group(1), 16))
    return sum(sizes.values())


class Peak:
    """The most ``staging_bytes`` seen while it runs, sampled every few milliseconds."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.most, self._stop = pids, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, staging_bytes(self.pids))
            time.sleep(0.002)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _state(n: int, seed: int) -> dict:
    return {"w": torch.randn(n, generator=torch.Generator().manual_seed(seed))}


def _save_two_layouts(tmp_path: Path, first: dict, second: dict, budget: int) -> int:
    """Saves ``first`` then ``second`` under ``budget``, the second's copy slowed down (the
    window where both layouts could be held); returns the peak while the second is saved,
    after checking both load back bit for bit."""
    with SyncCheckpointEngine(tmp_path / "ckpt", staging=Staging(max_host_bytes=budget)) as e:
        e.save(1, first).committed_sync(120)
        pids = [os.getpid(), e.worker_pid]
        assert staging_bytes(pids) > 0  # the first layout's buffers, mapped by both
        faults.inject("mid_stage", "delay", seconds=0.4)
        faults.inject("between_chunks", "delay", seconds=0.4)
        try:
            with Peak(pids) as peak:
                e.save(2, second).committed_sync(120)
        finally:
            faults.clear()
        for step, want in ((1, first), (2, second)):
            got = {"w": torch.zeros_like(want["w"])}
            e.load(got, step=step)
            assert_same(got, want)
    return peak.most


def test_a_new_layout_under_a_budget_never_holds_the_old_buffers_beside_it(tmp_path):
    """30 MiB, then another 30 MiB layout (one element fewer), under a 40 MiB budget."""
    n = 30 * MiB // 4
    peak = _save_two_layouts(tmp_path, _state(n, 1), _state(n - 1, 2), 40 * MiB)
    assert 20 * MiB < peak <= 40 * MiB, peak / MiB


def test_a_state_grown_over_the_budget_drops_its_whole_buffers_before_the_chunks(tmp_path):
    """30 MiB staged whole, then 60 MiB over the 40 MiB budget: staged in chunks, whose
    buffers are allocated only once the worker let go of the 30 MiB ones."""
    peak = _save_two_layouts(tmp_path, _state(30 * MiB // 4, 1), _state(60 * MiB // 4, 2), 40 * MiB)
    assert 0 < peak <= 40 * MiB, peak / MiB


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (neither gone nor a zombie); it may go between two reads."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] not in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_relayout_just_after_the_worker_died_fails_as_a_worker_death(tmp_path, monkeypatch):
    """Under a budget the old arenas' Drop is sent before the new ones are allocated, before
    the save waits for a worker: with the worker just killed and its death not yet handled,
    the save raised a bare ``BrokenPipeError``. Now the dead worker is left to ``send_job``,
    which waits for the new one (committed) or says ``WorkerDied``."""
    import signal

    from asyncckpt import WorkerDied
    from asyncckpt.trainer import supervisor

    real = supervisor.WorkerSupervisor._on_death

    def slow(self, proc, reason):  # a busy host: the death is handled half a second late
        time.sleep(0.5)
        return real(self, proc, reason)

    monkeypatch.setattr(supervisor.WorkerSupervisor, "_on_death", slow)
    with SyncCheckpointEngine(tmp_path / "ckpt", staging=Staging(max_host_bytes=8 * MiB)) as e:
        e.save(1, _state(MiB // 4, 1)).committed_sync(60)
        pid = e.worker_pid
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.001)
        try:
            e.save(2, _state(MiB // 4 + 1, 2)).committed_sync(120)  # another layout
        except WorkerDied:
            pass


def test_a_worker_that_never_says_it_let_go_delays_a_relayout_only_so_long(
    tmp_path, monkeypatch, caplog
):
    """The worker's word (``Dropped``) lost: the relayout waited for it forever. Now it waits
    ``DROP_WAIT_S`` at most, says so, and the save goes on (over the budget for a while)."""
    import threading

    from asyncckpt.core import messages as M
    from asyncckpt.trainer import saving, supervisor

    monkeypatch.setattr(saving, "DROP_WAIT_S", 0.5)
    real = supervisor.WorkerSupervisor._on_event

    def deaf(self, msg):
        if not isinstance(msg, M.Dropped):
            real(self, msg)

    monkeypatch.setattr(supervisor.WorkerSupervisor, "_on_event", deaf)
    done: list[object] = []
    with SyncCheckpointEngine(tmp_path / "ckpt", staging=Staging(max_host_bytes=8 * MiB)) as e:
        e.save(1, _state(MiB // 4, 1)).committed_sync(60)

        def second() -> None:
            done.append(e.save(2, _state(MiB // 4 + 1, 2)).committed_sync(60))

        with caplog.at_level("WARNING", logger="asyncckpt"):
            t = threading.Thread(target=second, daemon=True)
            t.start()
            t.join(60)
        assert not t.is_alive(), "the relayout waited for the worker's word forever"
    assert done and done[0].step == 2
    assert "did not say it let go of 1 old staging buffer(s)" in caplog.text
