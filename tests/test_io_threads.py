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


class _FakeCpu:
    """psutil's per-core idle times and the worker's own CPU time, moved by hand."""

    def __init__(self, cores: int, affinity: list[int] | None = None) -> None:
        self.idle = [0.0] * cores
        self.own = 0.0
        self.affinity = affinity if affinity is not None else list(range(cores))
        self.clock = 100.0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        class Proc:
            def cpu_affinity(self):
                return fake.affinity

            def cpu_times(self):
                return (fake.own, 0.0)

        monkeypatch.setattr(io.psutil, "Process", Proc)
        monkeypatch.setattr(
            io.psutil,
            "cpu_times",
            lambda percpu: [SimpleNamespace(idle=i, iowait=0.0) for i in fake.idle],
        )
        monkeypatch.setattr(io.time, "monotonic", lambda: fake.clock)

    def advance(self, seconds: float, idle_per_core: list[float], own: float = 0.0) -> None:
        self.clock += seconds
        self.idle = [i + seconds * f for i, f in zip(self.idle, idle_per_core, strict=True)]
        self.own += own


def test_auto_counts_idle_cores_since_the_last_save(monkeypatch):
    cpu = _FakeCpu(8)
    cpu.install(monkeypatch)
    threads = io.IoThreads("auto")
    cpu.advance(10.0, [0.0, 0.0] + [1.0] * 6)  # the trainer keeps two cores busy
    assert threads.idle_cores() == pytest.approx(6.0)
    cpu.advance(10.0, [0.0] * 7 + [0.5])  # then almost all of them
    assert threads.now() == 1
    cpu.advance(10.0, [1.0] * 8)
    assert threads.now() == io.AUTO_MAX


def test_the_workers_own_write_is_not_counted_as_the_trainers_load(monkeypatch):
    cpu = _FakeCpu(4)
    cpu.install(monkeypatch)
    threads = io.IoThreads("auto")
    # The worker's last write kept 3 cores busy for the whole interval; the trainer none.
    cpu.advance(10.0, [1.0, 0.0, 0.0, 0.0], own=30.0)
    assert threads.idle_cores() == pytest.approx(4.0)
    assert threads.now() == 1  # the reading above started a new interval: nothing idle since


def test_only_the_cores_the_worker_may_run_on_count_and_the_node_shares_them(monkeypatch):
    cpu = _FakeCpu(8, affinity=[6, 7])
    cpu.install(monkeypatch)
    threads = io.IoThreads("auto")
    cpu.advance(5.0, [1.0] * 8)
    assert threads.now() == 2  # 2 idle cores it may use, not 8
    cpu = _FakeCpu(8)
    cpu.install(monkeypatch)
    shared = io.IoThreads("auto", workers_per_node=4)
    cpu.advance(5.0, [1.0] * 8)
    assert shared.now() == 2  # 8 idle cores among 4 workers


def test_local_workers_from_the_node_local_layout_or_torchrun(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert io.local_workers(None) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert io.local_workers(None) == 8
    assert io.local_workers(SimpleNamespace(ranks_per_node=0)) == 8
    assert io.local_workers(SimpleNamespace(ranks_per_node=4)) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert io.local_workers(None) == 1


def test_a_real_reading_is_between_nothing_and_every_core():
    threads = io.IoThreads("auto")
    sum(i * i for i in range(200_000))
    idle = threads.idle_cores()
    assert 0.0 <= idle <= io.psutil.cpu_count() + 0.5
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
