"""Throttling: config validation, presets, the levers applied in a real child process, the
token bucket, the pause hint and short writes."""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time

import psutil
import pytest
import torch

from asyncckpt.io.throttle import (
    AppliedThrottle,
    Pacer,
    RateLimiter,
    ThrottleConfig,
    WritePause,
    apply_throttle,
    resolve,
    worker_cores,
    write_all,
)
from asyncckpt.testing import parts

# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"nice": -1},
        {"nice": 20},
        {"nice": True},
        {"nice": 1.5},
        {"cpu_cores": 0},
        {"cpu_cores": -2},
        {"cpu_cores": []},
        {"cpu_cores": [0, 0]},
        {"cpu_cores": [-1]},
        {"cpu_cores": "01"},
        {"cpu_cores": [0.5]},
        {"compute_threads": 0},
        {"io_threads": 0},
        {"io_threads": None},
        {"write_rate_bytes_per_s": 0},
        {"write_rate_bytes_per_s": -5.0},
        {"write_rate_bytes_per_s": float("nan")},
        {"write_rate_bytes_per_s": float("inf")},
        {"ionice": "yes"},
        {"direct_io": 1},
        {"max_pause_seconds": -1},
        {"max_pause_seconds": "2"},
        {"max_pause_seconds": float("nan")},
    ],
)
def test_invalid_config_is_a_clear_value_error(kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        ThrottleConfig(**kwargs)


def test_config_normalises_cores_and_stays_hashable() -> None:
    cfg = ThrottleConfig(cpu_cores=[3, 1])
    assert cfg.cpu_cores == (1, 3)
    assert hash(cfg) == hash(ThrottleConfig(cpu_cores=(1, 3)))
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_presets_and_resolve() -> None:
    off = ThrottleConfig.off()
    assert (off.nice, off.cpu_cores, off.compute_threads, off.ionice) == (0, None, None, False)
    assert off.write_rate_bytes_per_s is None

    opt = ThrottleConfig.for_optimizer_offload()
    assert opt == ThrottleConfig(
        nice=19, cpu_cores=1, compute_threads=1, io_threads=1, ionice=True, direct_io=True
    )
    assert opt.write_rate_bytes_per_s is None
    assert ThrottleConfig.for_optimizer_offload(5e6).write_rate_bytes_per_s == 5e6

    assert resolve(True, None) == opt
    default = ThrottleConfig.background()
    assert default == ThrottleConfig(nice=19, compute_threads=1, io_threads="auto", direct_io=True)
    assert not off.direct_io and off.max_pause_seconds == 0  # "off" ignores the pause hint
    assert resolve(False, None) == default
    mine = ThrottleConfig(nice=3)
    assert resolve(True, mine) is mine  # an explicit config wins over the preset
    with pytest.raises(ValueError, match="throttle"):
        resolve(True, {"nice": 3})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- apply_throttle


def _child(config: ThrottleConfig, out: mp.Queue, done: mp.Event) -> None:
    applied = apply_throttle(config)
    out.put((applied, torch.get_num_threads()))
    done.wait(60)  # stay alive so the parent can inspect this process from outside


def _run_child(config: ThrottleConfig):
    """Apply ``config`` in a spawned process; return what it reported and what psutil sees."""
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_child, args=(config, out, done), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while True:  # fail fast if the child dies instead of waiting out the timeout
            try:
                applied, threads = out.get(timeout=0.5)
                break
            except queue.Empty:
                assert proc.is_alive(), f"child exited with {proc.exitcode}"
                assert time.monotonic() < deadline, "child did not report in time"
        ps = psutil.Process(proc.pid)
        seen = {"nice": ps.nice(), "affinity": sorted(ps.cpu_affinity())}
        if hasattr(ps, "ionice"):
            seen["ionice"] = ps.ionice()
    finally:
        done.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return applied, threads, seen


needs_affinity = pytest.mark.skipif(
    not hasattr(psutil.Process, "cpu_affinity"), reason="no CPU affinity on this OS"
)


@needs_affinity
def test_offload_preset_applied_in_child_process() -> None:
    me = psutil.Process()
    allowed = sorted(me.cpu_affinity())
    applied, threads, seen = _run_child(ThrottleConfig.for_optimizer_offload())

    assert isinstance(applied, AppliedThrottle)  # crossed the process boundary by pickle
    assert applied.pid != os.getpid()
    assert seen["nice"] == min(19, me.nice() + 19) == applied.applied["nice"]
    assert seen["affinity"] == allowed[-1:]  # the last allowed core, the trainer keeps the rest
    assert applied.applied["cpu_cores"] == allowed[-1:]
    assert threads == 1 == applied.applied["compute_threads"]
    assert applied.applied["io_threads"] == 1
    if "ionice" in applied.applied and applied.applied["ionice"] == "idle":
        assert seen["ionice"].ioclass == psutil.IOPRIO_CLASS_IDLE
    # What was refused, if anything, says why; nothing else is in there.
    assert set(applied.failed) <= {"ionice", "interop_threads"}
    # And the parent is untouched.
    assert sorted(me.cpu_affinity()) == allowed


@needs_affinity
def test_explicit_cores_are_clamped_to_allowed() -> None:
    allowed = sorted(psutil.Process().cpu_affinity())
    applied, _, seen = _run_child(ThrottleConfig(cpu_cores=[allowed[0], 100_000]))
    assert seen["affinity"] == [allowed[0]] == applied.applied["cpu_cores"]

    applied, _, seen = _run_child(ThrottleConfig(cpu_cores=[100_000], nice=2))
    assert "cpu_cores" in applied.failed and "100000" in applied.failed["cpu_cores"]
    assert seen["affinity"] == allowed  # left alone, and the other levers still applied
    assert seen["nice"] == min(19, psutil.Process().nice() + 2)


def test_refused_lever_warns_and_never_raises(monkeypatch, caplog) -> None:
    def refuse(_: int) -> int:
        raise PermissionError("not allowed here")

    monkeypatch.setattr(os, "nice", refuse)
    with caplog.at_level(logging.WARNING, logger="asyncckpt.io.throttle"):
        applied = apply_throttle(ThrottleConfig(nice=5))
    assert applied.failed == {"nice": "PermissionError: not allowed here"}
    assert "nice" not in applied.applied
    assert any("nice" in r.getMessage() for r in caplog.records)
    assert pickle.loads(pickle.dumps(applied)) == applied


def test_default_config_changes_nothing() -> None:
    me = psutil.Process()
    before = (me.nice(), torch.get_num_threads())
    applied = apply_throttle(ThrottleConfig())
    assert applied.failed == {}
    assert set(applied.applied) == {"io_threads", "write_rate_bytes_per_s", "direct_io"}
    assert (me.nice(), torch.get_num_threads()) == before


# --------------------------------------------------------------------------- RateLimiter


def test_rate_limiter_lower_bound() -> None:
    rate, burst, total = 4e6, 250_000, 2_000_000
    limiter = RateLimiter(rate, burst_bytes=burst)
    t0 = time.monotonic()
    for _ in range(total // 100_000):
        limiter.acquire(100_000)
    elapsed = time.monotonic() - t0
    assert elapsed >= (total - burst) / rate * 0.95  # lower bound only: machines are noisy
    assert limiter.bytes_acquired == total


def test_rate_limiter_is_shared_across_threads() -> None:
    rate, burst = 4e6, 100_000
    limiter = RateLimiter(rate, burst_bytes=burst)

    def work() -> None:
        for _ in range(10):
            limiter.acquire(50_000)

    threads = [threading.Thread(target=work) for _ in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    assert elapsed >= (4 * 10 * 50_000 - burst) / rate * 0.95


def test_rate_limiter_debt_with_fake_clock() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    limiter = RateLimiter(1000.0, burst_bytes=100, clock=lambda: now[0], sleep=sleep)
    assert limiter.acquire(100) == 0.0  # the bucket starts full
    assert limiter.acquire(500) == pytest.approx(0.5)  # larger than the bucket: goes into debt
    now[0] += 10.0  # idle time refills only up to the burst
    assert limiter.acquire(100) == 0.0
    assert limiter.acquire(1) == pytest.approx(0.001)
    assert slept == pytest.approx([0.5, 0.001])


def test_rate_limiter_none_is_a_noop() -> None:
    def never(_: float) -> None:
        raise AssertionError("a None rate must never sleep")

    limiter = RateLimiter(None, sleep=never)
    assert limiter.acquire(10**15) == 0.0
    with pytest.raises(ValueError):
        RateLimiter(0)
    assert RateLimiter(1e9).burst_bytes == int(1e9 * 0.25)  # 0.25 s worth by default


# --------------------------------------------------------------------------- write_all


def test_write_all_finishes_short_writes() -> None:
    class Trickle(io.RawIOBase):
        """An unbuffered sink that accepts at most 7 bytes per call."""

        def __init__(self) -> None:
            self.buf = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            part = bytes(memoryview(b)[:7])
            self.buf += part
            return len(part)

    sink = Trickle()
    payload = b"0123456789abcdefghijklmnopqrstuvwxyz"
    write_all(sink, memoryview(payload))
    assert bytes(sink.buf) == payload

    class WouldBlock(Trickle):
        def write(self, b):
            return None

    with pytest.raises(BlockingIOError):
        write_all(WouldBlock(), memoryview(payload))


# --------------------------------------------------------------------------- pause hint


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.on_sleep = None  # called after each sleep: lets a test change the hint mid-wait

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(self.now)


def _pacer(pause, max_pause: float, t: _FakeTime, limiter=None) -> Pacer:
    return Pacer(limiter, pause, max_pause, clock=t.clock, sleep=t.sleep)


def test_write_pause_counts_nested_regions_and_pickles_to_a_spawned_child() -> None:
    pause = WritePause(mp.get_context("spawn"))
    assert not pause.active and pause.entries == 0
    pause.enter()
    pause.enter()
    pause.exit()
    assert pause.active and pause.entries == 2
    pause.exit()
    pause.exit()  # an extra exit never goes negative
    assert not pause.active
    # The worker gets it at spawn time and sees the trainer's updates (shared memory).
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    pause.enter()
    proc = ctx.Process(target=_report_pause, args=(pause, out), daemon=True)
    proc.start()
    try:
        assert out.get(timeout=120) == (True, 3)
        pause.exit()
        assert out.get(timeout=60) == (False, 3)
    finally:
        proc.join(30)


def _report_pause(pause: WritePause, out) -> None:
    out.put((pause.active, pause.entries))
    deadline = time.monotonic() + 60
    while pause.active and time.monotonic() < deadline:
        time.sleep(0.005)
    out.put((pause.active, pause.entries))


def test_pacer_waits_until_the_region_ends() -> None:
    t = _FakeTime()
    pause = WritePause(mp.get_context("spawn"))
    pacer = _pacer(pause, 5.0, t)
    pacer(1 << 20)  # no region: no wait
    assert t.now == 0 and pacer.paused_seconds == 0
    pause.enter()
    t.on_sleep = lambda now: pause.exit() if now >= 0.3 else None
    pacer(1 << 20)
    assert not pause.active
    assert 0.3 <= t.now < 0.31
    assert pacer.paused_seconds == pytest.approx(t.now)


def test_pacer_gives_up_on_a_region_longer_than_max_pause() -> None:
    t = _FakeTime()
    pause = WritePause(mp.get_context("spawn"))
    pacer = _pacer(pause, 0.5, t)
    pause.enter()
    pacer(1)
    assert t.now == pytest.approx(0.5, abs=0.002)  # waited max_pause, then wrote on
    pacer(1)
    pacer(1)
    assert t.now == pytest.approx(0.5, abs=0.002)  # same region: no second wait
    pause.exit()
    pause.enter()  # a new region holds the writes again
    pacer(1)
    assert t.now == pytest.approx(1.0, abs=0.004)
    assert pacer.paused_seconds == pytest.approx(1.0, abs=0.004)


def test_pacer_waits_anew_for_back_to_back_regions() -> None:
    t = _FakeTime()
    pause = WritePause(mp.get_context("spawn"))
    pacer = _pacer(pause, 0.5, t)
    pause.enter()

    def next_region(now: float) -> None:
        if now >= 0.4 and pause.entries == 1:
            pause.exit()
            pause.enter()  # the next optimizer step starts before the worker looked
        elif now >= 0.7:
            pause.exit()

    t.on_sleep = next_region
    pacer(1)
    # 0.4 s in region 1, then region 2 gets its own 0.5 s allowance and ends at 0.7 s.
    assert t.now == pytest.approx(0.7, abs=0.002)
    assert not pause.active


def test_pacer_zero_max_pause_ignores_the_hint_and_rate_still_applies() -> None:
    t = _FakeTime()
    pause = WritePause(mp.get_context("spawn"))
    pause.enter()
    limiter = RateLimiter(1000.0, burst_bytes=1000, clock=t.clock, sleep=t.sleep)
    pacer = _pacer(pause, 0.0, t, limiter)
    pacer(1000)
    pacer(1000)  # in debt: the rate cap sleeps, the pause hint does not
    assert t.now == pytest.approx(1.0)
    assert pacer.paused_seconds == 0


# --------------------------------------------------------------------------- engine


def _big_state() -> dict:
    return {"w": torch.randn(4 << 20), "step": 1}  # 16 MiB: 16 pieces for the pacer


@pytest.mark.anyio
async def test_pause_writes_holds_the_background_write(tmp_path) -> None:
    import anyio

    from asyncckpt import CheckpointEngine

    throttle = ThrottleConfig(max_pause_seconds=60)
    async with CheckpointEngine(tmp_path, throttle=throttle) as engine:
        await engine.prepare(_big_state())
        with engine.pause_writes():
            handle = await engine.save(1, _big_state())
            await anyio.sleep(1.0)
            assert not handle.done()  # held: nothing committed while the region is open
            assert engine.latest_step() is None
        stats = await handle.committed()
    assert stats.paused_seconds >= 0.8
    assert stats.paused_seconds <= stats.write_seconds


def test_pause_writes_never_holds_a_save_longer_than_max_pause(tmp_path) -> None:
    from asyncckpt import SyncCheckpointEngine

    throttle = ThrottleConfig(max_pause_seconds=0.3)
    with SyncCheckpointEngine(tmp_path, throttle=throttle) as engine:
        with engine.pause_writes():  # a region that outlasts the save
            stats = engine.save(1, _big_state()).committed_sync(timeout=60)
            assert engine.latest_step() == 1
        assert 0.25 <= stats.paused_seconds < 5


def test_pause_writes_during_hooks_the_optimizer_step(tmp_path) -> None:
    from asyncckpt import SyncCheckpointEngine

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.SGD([p], lr=0.1)
    with SyncCheckpointEngine(tmp_path) as engine:
        pause = parts(engine).write_pause
        seen: list[bool] = []
        hooks = engine.pause_writes_during(opt)
        opt.register_step_pre_hook(lambda *a: seen.append(pause.active))  # runs after ours
        opt.step()
        assert seen == [True] and not pause.active and pause.entries == 1

        # A step that raises leaves its region open; the next step closes it first.
        def boom(*a):
            raise RuntimeError("boom")

        h = opt.register_step_pre_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        assert pause.active
        h.remove()
        opt.step()
        assert not pause.active and pause.entries == 3

        hooks.remove()
        assert not pause.active
        opt.step()
        assert pause.entries == 3  # unhooked
        with pytest.raises(TypeError, match="Optimizer"):
            engine.pause_writes_during(object())


def test_worker_cores_give_each_local_rank_its_own_block() -> None:
    cores = list(range(8))
    assert worker_cores(cores, 1) == [7]
    assert [worker_cores(cores, 1, r) for r in range(4)] == [[7], [6], [5], [4]]
    assert [worker_cores(cores, 2, r) for r in range(4)] == [[6, 7], [4, 5], [2, 3], [0, 1]]
    assert worker_cores(cores, 1, 8) == [7]  # more ranks than cores: wraps around
    assert worker_cores([3, 1, 9], 5) == [1, 3, 9]  # more asked than allowed: all of them
    assert worker_cores([0, 1], 1, 1) == [0]  # 2 cores, 2 ranks: one each
    with pytest.raises(ValueError):
        worker_cores([], 1)


def test_a_pause_waited_out_by_several_writer_threads_counts_its_wall_time_once() -> None:
    """With io_threads > 1 every writer thread waits out the same pause: the save was held
    for that pause's length, not for the sum of its threads' waits."""
    pause = WritePause(mp.get_context("spawn"))
    t = _FakeTime()
    pacer = _pacer(pause, 30.0, t)
    both_waiting = threading.Barrier(2, timeout=30)
    first_sleep: set[int] = set()
    lock = threading.Lock()

    def on_sleep(now: float) -> None:
        me = threading.get_ident()
        if me not in first_sleep:
            first_sleep.add(me)
            both_waiting.wait()  # both threads are inside the pause before it can end
        with lock:
            if now >= 1.0 and pause.active:
                pause.exit()

    t.on_sleep = on_sleep
    pause.enter()
    writers = [threading.Thread(target=pacer, args=(1 << 20,)) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(30)
    assert not any(w.is_alive() for w in writers)
    # The shared fake clock ran from 0 to just past 1.0 s while both waited: once, not twice.
    assert 1.0 <= pacer.paused_seconds < 1.1, pacer.paused_seconds
    assert pacer.figures()["throttled_seconds"] == pacer.paused_seconds


def test_a_rate_cap_sleep_beside_a_pause_wait_counts_their_wall_time_once() -> None:
    """One writer thread sleeps on the rate cap while another waits out the pause, both over
    the same second: the save was held that second, not two (their sum)."""
    pause = WritePause(mp.get_context("spawn"))
    t = _FakeTime()
    inside = threading.Barrier(2, timeout=30)
    moved = threading.Barrier(2, timeout=30)

    def limiter_sleep(seconds: float) -> None:
        inside.wait()  # the other thread waits out the pause meanwhile
        t.now += 1.0
        moved.wait()

    limiter = RateLimiter(1000.0, burst_bytes=1, clock=t.clock, sleep=limiter_sleep)
    pacer = _pacer(pause, 30.0, t, limiter)
    polls = 0

    def on_sleep(now: float) -> None:
        nonlocal polls
        if threading.current_thread() is paused:
            polls += 1
            if polls == 1:  # its first poll: the pause ends, but this wait is still held
                inside.wait()  # until the clock moved (the capped thread wakes to no pause)
                pause.exit()
                moved.wait()

    t.on_sleep = on_sleep
    pacer.begin(None)
    pause.enter()
    capped = threading.Thread(target=pacer, args=(1001,))  # 1 s in debt
    paused = threading.Thread(target=pacer, args=(0,))  # 0 bytes: not capped, only paused
    for w in (capped, paused):
        w.start()
    for w in (capped, paused):
        w.join(30)
    assert not capped.is_alive() and not paused.is_alive()
    assert 1.0 <= pacer.paused_seconds < 1.1
    assert 1.0 <= pacer.throttled_seconds < 1.1, (pacer.throttled_seconds, pacer.paused_seconds)


def test_two_writers_in_debt_at_once_count_their_wall_time_once() -> None:
    """Two writer threads reserve from the rate cap at the same moment and sleep side by side
    (1 s and 2 s): the save was held until the later one woke, 2 s, not 3 s (their sum)."""
    t = _FakeTime()
    both_asleep = threading.Barrier(2, timeout=30)
    moved = threading.Barrier(2, timeout=30)
    slept: list[float] = []
    lock = threading.Lock()

    def limiter_sleep(seconds: float) -> None:
        with lock:
            slept.append(seconds)
        both_asleep.wait()
        if seconds > 1.5:  # the later one moves the clock to when both have woken
            t.now += 2.0
        moved.wait()

    limiter = RateLimiter(1000.0, burst_bytes=1, clock=t.clock, sleep=limiter_sleep)
    pacer = _pacer(None, 0.0, t, limiter)
    pacer.begin(None)
    limiter.acquire(1)  # empty the bucket; both reserve at t=0 below
    writers = [threading.Thread(target=pacer, args=(1000,)) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(30)
    assert not any(w.is_alive() for w in writers)
    assert sorted(slept) == pytest.approx([1.0, 2.0])
    assert pacer.throttled_seconds == pytest.approx(2.0)
