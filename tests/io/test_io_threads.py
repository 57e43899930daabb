"""io_threads="auto": files written at once follow the cores the trainer left idle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncckpt import ThrottleConfig
from asyncckpt.io import io_threads as io


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


def reading(at, per_core, cores=None, own=0.0, quota=None, total=None, pool=None):
    """A CpuReading: ``per_core`` a list (CPU ids 0..n-1) or a dict by CPU id."""
    by_id = per_core if isinstance(per_core, dict) else dict(enumerate(per_core))
    return io.CpuReading(
        at=at,
        per_core_idle=by_id,
        total_idle=sum(by_id.values()) if total is None else total,
        cores=tuple(cores if cores is not None else sorted(by_id)),
        own=own,
        quota=quota,
        pool=frozenset(pool) if pool is not None else None,
    )


def test_idle_cores_are_counted_on_the_cores_the_worker_may_use_since_the_last_save():
    before = reading(0.0, [0.0] * 8)
    # The trainer kept cores 0 and 1 busy for 10 s; the others idle.
    after = reading(10.0, [0.0, 0.0] + [10.0] * 6)
    assert io.idle_between(before, after) == (pytest.approx(6.0), 1.0)
    pinned = reading(10.0, [0.0, 0.0] + [10.0] * 6, cores=[1, 2], pool=range(8))
    assert io.idle_between(before, pinned) == (pytest.approx(1.0), 0.25)
    # No cgroup names the job's CPU set: the 2 cores may be every local rank's (share 1).
    unknown = reading(10.0, [0.0, 0.0] + [10.0] * 6, cores=[1, 2])
    assert io.idle_between(before, unknown) == (pytest.approx(1.0), 1.0)


def test_the_workers_own_write_is_not_counted_as_the_trainers_load():
    before = reading(0.0, [0.0] * 4)
    # The worker's last write kept 3 cores busy for the whole 10 s; the trainer none.
    after = reading(10.0, [10.0, 0.0, 0.0, 0.0], own=30.0)
    assert io.idle_between(before, after)[0] == pytest.approx(4.0)


def test_affinity_ids_without_per_cpu_times_use_the_machines_idle_time():
    """A container's renumbering: the ids the affinity names have no per-CPU times, so the
    machine's idle time, scaled to the allowed cores, is used."""
    before = reading(0.0, [0.0] * 4, cores=[10, 11], total=0.0)
    after = reading(10.0, [5.0] * 4, cores=[10, 11], total=40.0)
    assert io.idle_between(before, after) == (pytest.approx(2.0), 1.0)


def test_an_offline_cpu_leaves_the_others_counted_by_their_ids():
    """CPU 1 offline: /proc/stat has no line for it, so positions are not ids (psutil's list
    would have put CPU 2's times under 1). Counting by id reads the allowed cores' own."""
    before = reading(0.0, {0: 0.0, 2: 0.0, 3: 0.0}, cores=[2, 3])
    after = reading(10.0, {0: 0.0, 2: 10.0, 3: 10.0}, cores=[2, 3])  # CPU 0 busy
    assert io.idle_between(before, after)[0] == pytest.approx(2.0)


def test_per_cpu_idle_is_read_by_cpu_id_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  10 0 10 500 20 0 0 0 0 0\n"
        "cpu0 5 0 5 100 10 0 0 0 0 0\n"
        "cpu2 5 0 5 400 10 0 0 0 0 0\n"  # cpu1 offline: no line
        "intr 1 2 3\n"
    )
    tick = io.os.sysconf("SC_CLK_TCK")
    assert io.per_cpu_idle(stat) == {0: 110 / tick, 2: 410 / tick}
    assert io.per_cpu_idle(tmp_path / "missing") is None


@pytest.mark.skipif(
    not hasattr(io.psutil.Process, "cpu_affinity"), reason="no CPU affinity on this OS"
)
def test_a_real_reading_counts_the_affinitys_cores_by_id():
    r = io.read_cpu()
    assert r.cores and set(r.cores) <= set(r.per_core_idle)


def test_a_cgroup_quota_caps_the_idle_cores_at_what_it_leaves_unused():
    """A pod limited to 2 CPUs on an idle 16-core host must not count 16 idle cores."""
    before = reading(0.0, [0.0] * 16, quota=(2.0, 100.0))
    after = reading(10.0, [10.0] * 16, quota=(2.0, 105.0))  # the pod used 0.5 core
    assert io.idle_between(before, after)[0] == pytest.approx(1.5)
    busy = reading(10.0, [10.0] * 16, quota=(2.0, 120.0), own=5.0)  # 2 cores, 0.5 the worker's
    assert io.idle_between(before, busy)[0] == pytest.approx(0.5)


def test_the_job_sharing_a_cpu_set_never_gets_more_threads_than_its_idle_cores(monkeypatch):
    """8 local ranks in a Slurm job or container allowed 32 of a machine's 128 cores, every
    rank's affinity those 32, 16 of them idle: 2 files each (16 in all), not 4 each (32 on 16
    idle cores: the share used to be taken against the machine's 128)."""
    job = range(96, 128)
    idle = {c: (10.0 if c >= 112 else 0.0) for c in range(128)}
    readings = iter(
        [
            reading(0.0, dict.fromkeys(range(128), 0.0), cores=job, pool=job),
            reading(10.0, idle, cores=job, pool=job),
        ]
    )
    monkeypatch.setattr(io, "read_cpu", lambda: next(readings))
    assert io.IoThreads("auto", workers_per_node=8).now() == 2


def test_auto_shares_the_idle_cores_among_the_workers_that_may_use_them(monkeypatch):
    readings = iter(
        [
            reading(0.0, [0.0] * 8),
            reading(10.0, [10.0] * 8),  # all 8 idle, 4 workers on them: 2 each
            # pinned to 2 of the job's 8: the share is 1/4
            reading(20.0, [20.0] * 8, cores=[6, 7], pool=range(8)),
            reading(30.0, [30.0] * 8, cores=[6, 7]),  # no CPU set named: maybe every rank's
        ]
    )
    monkeypatch.setattr(io, "read_cpu", lambda: next(readings))
    threads = io.IoThreads("auto", workers_per_node=4)
    assert threads.now() == 2
    assert threads.now() == 2  # its own 2 cores, shared by 4 x 1/4 = 1 worker
    assert threads.now() == 1  # 2 cores that 4 workers may share: never more than the cores


def test_a_reading_the_os_refuses_writes_one_file_at_a_time_said_once(monkeypatch, caplog):
    def refused():
        raise io.psutil.AccessDenied(pid=1)

    monkeypatch.setattr(io, "read_cpu", refused)
    with caplog.at_level("WARNING", logger="asyncckpt.io.throttle"):
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

    # 1 MiB each: a file of its own each (small ones would share one file: one writer)
    state = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(8)}

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


def test_a_saves_io_threads_is_what_its_writers_ran_not_what_was_asked(tmp_path):
    """Fewer shard files than threads, or a one-file format, write fewer files at once than
    ``io_threads`` asks: SaveStats says what ran (it said the setting)."""
    import torch

    from asyncckpt import SyncCheckpointEngine
    from asyncckpt.core import layout

    state = {"w": torch.full((1 << 14,), 1.0)}
    throttle = ThrottleConfig.background(io_threads=3)
    with SyncCheckpointEngine(tmp_path / "dcp", throttle=throttle) as engine:
        ran = engine.save(1, state).committed_sync().io_threads
    files = list((tmp_path / "dcp" / layout.dir_name("global_step", 1)).glob("*.distcp"))
    assert ran == len(files) < 3
    layout_ = {"layout": "megatron", "format": "megatron_legacy"}
    with SyncCheckpointEngine(tmp_path / "legacy", throttle=throttle, **layout_) as engine:
        assert engine.save(1, state).committed_sync().io_threads == 1  # one file


def test_a_fixed_io_threads_setting_holds_after_a_save_written_one_file_at_a_time():
    """A chunked save writes one file at a time; the next save writes as many as set (the
    chunked save's 1 used to stick as the setting)."""
    threads = io.IoThreads(4)
    assert threads.write_options()["thread_count"] == 4
    threads.wrote_one_at_a_time()
    assert threads.used == 1
    options = threads.write_options()
    assert options["thread_count"] == 4 and options["threads_used"] == []
    options["threads_used"].append(4)
    assert threads.used == 4


def test_a_full_save_of_fewer_items_than_threads_writes_no_empty_files(tmp_path):
    """With differential saves off, items split over the threads as DCP splits them; more
    threads than items wrote empty shard files and reported the setting as what ran."""
    import torch

    from asyncckpt import Staging, SyncCheckpointEngine
    from asyncckpt.core import layout

    state = {"a": torch.full((1 << 12,), 1.0), "b": torch.full((1 << 12,), 2.0)}
    throttle = ThrottleConfig.background(io_threads=8)
    staging = Staging(differential=False)
    with SyncCheckpointEngine(tmp_path, throttle=throttle, staging=staging) as engine:
        ran = engine.save(1, state).committed_sync().io_threads
    files = list((tmp_path / layout.dir_name("global_step", 1)).glob("*.distcp"))
    assert all(f.stat().st_size > 0 for f in files), sorted(f.stat().st_size for f in files)
    assert ran == len(files) < 8
