"""io_threads="auto": files written at once follow the cores the trainer left idle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncckpt import ThrottleConfig
from asyncckpt import io_threads as io


@pytest.mark.parametrize(
    ("idle", "workers", "want"),
    [(0.0, 1, 1), (-1.0, 1, 1), (0.9, 1, 1), (1.0, 1, 1), (2.5, 1, 2), (3.99, 1, 3),
     (7.9, 1, 4), (64.0, 1, 4), (3.0, 2, 1), (8.0, 2, 4), (8.0, 8, 1), (16.0, 0, 4)],
)  # fmt: skip
def test_auto_count_is_one_file_per_idle_core_of_this_workers_share(idle, workers, want):
    assert io.auto_count(idle, workers) == want


@pytest.mark.parametrize("bad", [0, -1, 1.5, None, True, "AUTO", "2", "", [2]])
def test_bad_settings_are_refused_by_the_config(bad):
    with pytest.raises(ValueError, match="io_threads must be an int >= 1 or 'auto'"):
        ThrottleConfig(io_threads=bad)


def test_presets_adapt_by_default_and_stay_at_one_file_for_optimizer_offload():
    assert ThrottleConfig.background().io_threads == "auto"
    # The offload preset's promise (offload_throttle.py) rests on one writer thread.
    assert ThrottleConfig.for_optimizer_offload().io_threads == 1
    assert ThrottleConfig(io_threads=3).io_threads == 3


def test_a_fixed_count_is_used_as_given_without_reading_the_cpu(monkeypatch):
    def no_reading(*a, **k):
        raise AssertionError("a fixed io_threads must not read the CPU")

    monkeypatch.setattr(io.psutil, "cpu_times", no_reading)
    assert io.IoThreads(3).now() == 3
    assert io.IoThreads(1).now() == 1


def reading(at, per_core, cores=None, own=0.0, quota=None, total=None) -> io.CpuReading:
    return io.CpuReading(
        at=at,
        per_core_idle=tuple(per_core),
        total_idle=sum(per_core) if total is None else total,
        cores=tuple(cores if cores is not None else range(len(per_core))),
        own=own,
        quota=quota,
    )


def test_idle_cores_are_counted_on_the_cores_the_worker_may_use_since_the_last_save():
    before = reading(0.0, [0.0] * 8)
    # The trainer kept cores 0 and 1 busy for 10 s; the others idle.
    after = reading(10.0, [0.0, 0.0] + [10.0] * 6)
    assert io.idle_between(before, after) == (pytest.approx(6.0), 1.0)
    pinned = reading(10.0, [0.0, 0.0] + [10.0] * 6, cores=[1, 2])
    assert io.idle_between(before, pinned) == (pytest.approx(1.0), 0.25)


def test_the_workers_own_write_is_not_counted_as_the_trainers_load():
    before = reading(0.0, [0.0] * 4)
    # The worker's last write kept 3 cores busy for the whole 10 s; the trainer none.
    after = reading(10.0, [10.0, 0.0, 0.0, 0.0], own=30.0)
    assert io.idle_between(before, after)[0] == pytest.approx(4.0)


def test_a_numbering_that_does_not_match_the_affinity_ids_uses_the_machines_idle_time():
    """Offline CPUs or a container's renumbering: psutil's list positions are not the ids the
    affinity names, so the machine's idle time, scaled to the allowed cores, is used."""
    before = reading(0.0, [0.0] * 4, cores=[10, 11], total=0.0)
    after = reading(10.0, [5.0] * 4, cores=[10, 11], total=40.0)
    assert io.idle_between(before, after) == (pytest.approx(2.0), 0.5)
    shrunk = reading(10.0, [5.0] * 3, total=30.0)  # a CPU went offline in between
    idle, _ = io.idle_between(reading(0.0, [0.0] * 4, total=0.0), shrunk)
    assert idle == pytest.approx(3.0)


def test_a_cgroup_quota_caps_the_idle_cores_at_what_it_leaves_unused():
    """A pod limited to 2 CPUs on an idle 16-core host must not count 16 idle cores."""
    before = reading(0.0, [0.0] * 16, quota=(2.0, 100.0))
    after = reading(10.0, [10.0] * 16, quota=(2.0, 105.0))  # the pod used 0.5 core
    assert io.idle_between(before, after)[0] == pytest.approx(1.5)
    busy = reading(10.0, [10.0] * 16, quota=(2.0, 120.0), own=5.0)  # 2 cores, 0.5 the worker's
    assert io.idle_between(before, busy)[0] == pytest.approx(0.5)


def test_cgroup_quota_is_read_from_cpu_max_and_cpu_stat(tmp_path):
    assert io.cgroup_quota(tmp_path) is None  # no cgroup v2 files
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 1\n")
    assert io.cgroup_quota(tmp_path) is None  # no quota
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert io.cgroup_quota(tmp_path) == (2.5, 2.5)
    (tmp_path / "cpu.stat").write_text("garbage\n")
    assert io.cgroup_quota(tmp_path) is None


def test_auto_shares_the_idle_cores_among_the_workers_that_may_use_them(monkeypatch):
    readings = iter(
        [
            reading(0.0, [0.0] * 8),
            reading(10.0, [10.0] * 8),  # all 8 idle, 4 workers on them: 2 each
            reading(20.0, [20.0] * 8, cores=[6, 7]),  # pinned to 2 of 8: the share is 1/4
        ]
    )
    monkeypatch.setattr(io, "read_cpu", lambda: next(readings))
    threads = io.IoThreads("auto", workers_per_node=4)
    assert threads.now() == 2
    assert threads.now() == 2  # its own 2 cores, shared by 4 x 1/4 = 1 worker


def test_a_reading_the_os_refuses_writes_one_file_at_a_time_said_once(monkeypatch, caplog):
    def refused():
        raise io.psutil.AccessDenied(pid=1)

    monkeypatch.setattr(io, "read_cpu", refused)
    with caplog.at_level("WARNING", logger="asyncckpt.throttle"):
        threads = io.IoThreads("auto")
        assert [threads.now() for _ in range(3)] == [1, 1, 1]
    assert len([r for r in caplog.records if "cannot read the CPU" in r.getMessage()]) == 1


def test_local_workers_from_the_node_local_layout_or_the_launcher(monkeypatch):
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert io.local_workers(None) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert io.local_workers(None) == 8
    assert io.local_workers(SimpleNamespace(ranks_per_node=0)) == 8
    assert io.local_workers(SimpleNamespace(ranks_per_node=4)) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert io.local_workers(None) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")
    assert io.local_workers(None) == 8
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert io.local_workers(None) == 4


def test_a_real_reading_is_between_nothing_and_every_core():
    threads = io.IoThreads("auto")
    sum(i * i for i in range(200_000))
    idle, share = threads.idle_cores()
    assert 0.0 <= idle <= io.psutil.cpu_count() + 0.5
    assert 0.0 < share <= 1.0
    assert 1 <= threads.now() <= io.AUTO_MAX


def test_a_saves_stats_say_how_many_files_its_worker_wrote_at_once(tmp_path):
    import anyio
    import torch

    from asyncckpt import CheckpointEngine, Preemption

    state = {f"w{i}": torch.full((1 << 14,), float(i)) for i in range(8)}

    async def saved(setting: io.IoThreadsSetting) -> int:
        async with CheckpointEngine(
            tmp_path / str(setting),
            throttle=ThrottleConfig.background(io_threads=setting),
            preemption=Preemption(handle_sigterm=False),
        ) as engine:
            handle = await engine.save(1, state)
            return (await handle.committed()).io_threads

    assert anyio.run(saved, 3) == 3
    assert 1 <= anyio.run(saved, "auto") <= io.AUTO_MAX
    assert anyio.run(saved, 1) == 1
