"""The core engine: staging, async write, commit, tracker, load, errors (issue 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from statecmp import assert_same

from asyncckpt import (
    CheckpointEngine,
    CheckpointError,
    Preemption,
    RootLocked,
    SaveFailed,
    Staging,
    StagingMemoryError,
    SyncCheckpointEngine,
    WorkerDied,
    faults,
)
from asyncckpt.core import layout as L
from asyncckpt.testing import parts

pytestmark = pytest.mark.anyio
both_backends = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def rich_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for dt in DTYPES:
        if dt == torch.bool:
            tensors[str(dt)] = torch.rand(7, 3, generator=g) > 0.5
        elif dt.is_floating_point or dt.is_complex:
            tensors[str(dt)] = torch.randn(5, 4, generator=g).to(dt)
        else:
            tensors[str(dt)] = torch.randint(0, 100, (9,), generator=g).to(dt)
    return {
        "model": {
            "layers": [torch.randn(3, 3, generator=g), torch.randn(2, generator=g)],
            **tensors,
        },
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "noncontig": torch.randn(6, 4, generator=g).t(),
        "data": {"epoch": 4, "name": "run-a", "lr": 1e-3, "hist": [1, 2, 3], "cfg": {"a": None}},
        "rng": torch.get_rng_state(),
        "blob": b"\x00\x01bytes",
        "tuple": (1, "two"),
    }


def blank_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: blank_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank_like(v) for v in state]
    return None


@both_backends
async def test_round_trip_every_dtype_bit_for_bit(tmp_path, anyio_backend):
    state = rich_state()
    async with CheckpointEngine(tmp_path) as engine:
        handle = await engine.save(7, state, metrics={"loss": 0.5})
        stats = await handle.committed()
    assert stats.bytes > 0 and stats.write_seconds > 0 and stats.committed_at
    assert (tmp_path / "global_step_7" / ".metadata").exists()
    target = blank_like(state)
    step = await CheckpointEngine(tmp_path).load_latest(target)
    assert step == 7
    assert_same(state, target)


async def test_stateful_module_and_optimizer_restored_in_place(tmp_path, anyio_backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    async with CheckpointEngine(tmp_path) as engine:
        await engine.save(2, {"model": model, "optim": opt, "extra": {"step": 2}})
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)  # fresh: no state yet
    weight = model2[0].weight
    state2 = {"model": model2, "optim": opt2, "extra": {}}
    assert await CheckpointEngine(tmp_path).load_latest(state2) == 2
    assert model2[0].weight is weight  # in place
    assert_same(model.state_dict(), model2.state_dict())
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert_same(s1["state"], s2["state"])
    assert s1["param_groups"] == s2["param_groups"]
    assert state2["extra"] == {"step": 2}


@both_backends
async def test_save_returns_before_the_write_finishes(tmp_path, anyio_backend):
    state = {"w": torch.randn(100)}
    async with CheckpointEngine(tmp_path) as engine:
        # The first save also waits for the worker's start-up (start() does not): a warm one.
        await (await engine.save(0, state)).committed()
        faults.inject("before_shard_write", "delay:1.5")
        t0 = time.perf_counter()
        handle = await engine.save(1, state)
        returned_after = time.perf_counter() - t0
        assert not handle.done()
        assert not (tmp_path / "global_step_1").exists()
        await handle.committed()
        assert time.perf_counter() - t0 >= 1.5 > returned_after
    assert (tmp_path / "global_step_1").is_dir()


async def test_mutating_state_right_after_save_does_not_change_what_is_written(
    tmp_path, anyio_backend
):
    faults.inject("before_shard_write", "delay:0.5")
    state = {"opt": {"exp_avg": torch.ones(1000)}, "meta": {"seen": [1, 2]}}
    async with CheckpointEngine(tmp_path) as engine:
        handle = await engine.save(1, state)
        state["opt"]["exp_avg"].mul_(7)  # an offloaded optimizer step, in place
        state["meta"]["seen"].append(3)
        await handle.committed()
    target = {"opt": {"exp_avg": torch.zeros(1000)}, "meta": {}}
    await CheckpointEngine(tmp_path).load_latest(target)
    assert torch.equal(target["opt"]["exp_avg"], torch.ones(1000))
    assert target["meta"]["seen"] == [1, 2]


def test_loads_with_plain_dcp_without_asyncckpt(tmp_path):
    state = rich_state(1)
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(3, state)
    torch.save(state, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        import torch.distributed.checkpoint as dcp
        expected = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=False)
        def blank(s):
            if isinstance(s, torch.Tensor): return torch.zeros_like(s)
            if isinstance(s, dict): return {{k: blank(v) for k, v in s.items()}}
            if isinstance(s, list): return [blank(v) for v in s]
            return s
        sd = blank(expected)
        dcp.load(sd, checkpoint_id={str(tmp_path / "global_step_3")!r})
        def same(a, b):
            if isinstance(a, torch.Tensor): return a.dtype == b.dtype and torch.equal(a, b)
            if isinstance(a, dict): return all(same(a[k], b[k]) for k in a)
            if isinstance(a, (list, tuple)): return all(same(x, y) for x, y in zip(a, b))
            return a == b
        assert same(expected, sd), "mismatch"
        assert "asyncckpt" not in sys.modules
        print("OK")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout


async def test_tracker_is_written_only_after_the_commit(tmp_path, anyio_backend):
    async with CheckpointEngine(tmp_path) as engine:
        await (await engine.save(1, {"w": torch.ones(3)})).committed()
        assert L.read_tracker(tmp_path) == 1
        faults.inject("before_rename", "delay:1.0")
        handle = await engine.save(2, {"w": torch.ones(3)})
        # While the new checkpoint is durable in its temporary but not renamed:
        deadline = time.monotonic() + 10
        while not any(n.startswith(L.TMP_PREFIX + "global_step_2") for n in os.listdir(tmp_path)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert L.read_tracker(tmp_path) == 1
        assert not (tmp_path / "global_step_2").exists()
        assert [c.step for c in engine.list_checkpoints()] == [1]
        await handle.committed()
        assert L.read_tracker(tmp_path) == 2
        assert (tmp_path / L.SKYRL_TRACKER).read_text().strip() == "2"
        faults.inject("before_tracker", "delay:1.0")
        handle = await engine.save(3, {"w": torch.ones(3)})
        deadline = time.monotonic() + 10
        while not (tmp_path / "global_step_3").exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert L.read_tracker(tmp_path) == 2  # renamed first, tracker after
        await handle.committed()
        assert L.read_tracker(tmp_path) == 3


async def test_leftover_temporaries_are_never_listed_and_removed_at_start(tmp_path, anyio_backend):
    async with CheckpointEngine(tmp_path) as engine:
        await engine.save(1, {"w": torch.ones(3)})
    tmp_dir = tmp_path / L.tmp_name("global_step", 2, "dead")
    tmp_dir.mkdir()
    (tmp_dir / "__0_0.distcp").write_bytes(b"partial")
    trash = tmp_path / L.trash_name("global_step_0", "x")
    trash.mkdir()
    engine = CheckpointEngine(tmp_path)
    assert [c.step for c in engine.list_checkpoints()] == [1]
    assert engine.latest_step() == 1
    with pytest.raises(CheckpointError):
        await engine.load({"w": torch.zeros(3)}, path=tmp_dir)
    async with engine:
        assert not tmp_dir.exists() and not trash.exists()


@both_backends
async def test_worker_death_fails_the_handle_and_a_new_worker_takes_over(tmp_path, anyio_backend):
    faults.inject("before_shard_write", "hang")
    async with CheckpointEngine(tmp_path) as engine:
        first_pid = engine.worker_pid
        handle = await engine.save(1, {"w": torch.ones(10)})
        time.sleep(0.5)
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match="died"):
            await handle.committed()
        assert not (tmp_path / "global_step_1").exists()
        # The failure also surfaces on the next save... unless already observed on the handle.
        handle = await engine.save(2, {"w": torch.full((10,), 2.0)})
        await handle.committed()
        assert engine.worker_pid != first_pid and engine.worker_restarts == 1
    target = {"w": torch.zeros(10)}
    assert await CheckpointEngine(tmp_path).load_latest(target) == 2
    assert torch.equal(target["w"], torch.full((10,), 2.0))


@both_backends
async def test_a_failed_write_surfaces_on_the_handle_and_the_next_save(tmp_path, anyio_backend):
    async with CheckpointEngine(tmp_path) as engine:
        faults.inject("mid_shard_write", "eio")
        handle = await engine.save(1, {"w": torch.ones(10)})
        while not handle.done():
            time.sleep(0.01)
        with pytest.raises(SaveFailed) as info:
            await engine.save(2, {"w": torch.ones(10)})
        assert isinstance(info.value.__cause__, OSError)
        assert not (tmp_path / "global_step_2").exists()
        await (await engine.save(2, {"w": torch.ones(10)})).committed()
    assert sorted(os.listdir(tmp_path)) == sorted(
        n for n in os.listdir(tmp_path) if not L.is_leftover(n)
    )
    assert [p for p in os.listdir(tmp_path) if p.startswith("global_step")] == ["global_step_2"]


@both_backends
async def test_backpressure_waits_for_a_free_buffer_and_reports_it(tmp_path, anyio_backend):
    faults.inject("before_shard_write", "delay:0.8")
    state = {"w": torch.randn(1000)}
    async with CheckpointEngine(tmp_path, staging=Staging(max_in_flight=1)) as engine:
        h1 = await engine.save(1, state)
        h2 = await engine.save(2, state)
        # the second save could stage only once the first had written its shards
        assert not (tmp_path / L.tmp_name("global_step", 1, "x")).exists()
        assert h2.stats.wait_seconds >= 0.3
        assert h1.stats.wait_seconds < 0.3
        await engine.wait()
    assert engine.latest_step() == 2


@both_backends
async def test_a_save_cancelled_while_it_waits_for_a_buffer_gives_it_back(tmp_path, anyio_backend):
    """A save cancelled (a timeout around it) while it waited for the one staging buffer kept
    the buffer its thread went on to reserve: every later save waited forever."""
    import anyio

    faults.inject("before_shard_write", "delay:1.0")
    state = {"w": torch.randn(1000)}
    async with CheckpointEngine(tmp_path, staging=Staging(max_in_flight=1)) as engine:
        await engine.save(1, state)
        with anyio.move_on_after(0.3) as scope:
            await engine.save(2, state)  # waits for step 1's buffer
        faults.clear()
        await engine.wait()
        with anyio.fail_after(30):
            h = await engine.save(3, state)
            await h.committed()
    assert scope.cancelled_caught or engine.latest_step() == 3
    assert engine.latest_step() == 3


def test_a_save_cancelled_by_asyncio_while_it_waits_for_a_buffer_gives_it_back(tmp_path):
    """The same under asyncio's own cancellation (``asyncio.wait_for``, ``task.cancel()``)."""
    import asyncio

    async def run() -> None:
        faults.inject("before_shard_write", "delay:1.0")
        state = {"w": torch.randn(1000)}
        async with CheckpointEngine(tmp_path, staging=Staging(max_in_flight=1)) as engine:
            await engine.save(1, state)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(engine.save(2, state), 0.3)
            faults.clear()
            await engine.wait()
            h = await asyncio.wait_for(engine.save(3, state), 30)
            await asyncio.wait_for(h.committed(), 30)
        assert engine.latest_step() == 3

    asyncio.run(run())


async def test_arenas_are_allocated_once_and_reused(tmp_path, anyio_backend):
    state = {"w": torch.randn(256, 256), "b": torch.randn(10)}
    async with CheckpointEngine(tmp_path) as engine:
        await engine.prepare(state)
        slot = parts(engine).saver.slots[0]
        arena_ids = list(slot.arena_ids)
        for step in range(1, 4):
            state["w"].add_(1)
            h = await engine.save(step, state)
            assert h.stats.alloc_seconds == 0.0
            await h.committed()
        assert slot.arena_ids == arena_ids and len(slot.arenas) == 1
    target = {"w": torch.zeros(256, 256), "b": torch.zeros(10)}
    await CheckpointEngine(tmp_path).load_latest(target)
    assert torch.equal(target["w"], state["w"])


async def test_on_commit_callback_receives_the_figures(tmp_path, anyio_backend):
    seen = []
    async with CheckpointEngine(tmp_path, on_commit=seen.append) as engine:
        await engine.save(5, {"w": torch.ones(1000)})
        await engine.wait()
    (stats,) = seen
    d = stats.as_dict()
    for key in ("stage_seconds", "wait_seconds", "write_seconds", "commit_seconds", "bytes"):
        assert key in d
    assert stats.step == 5 and stats.bytes > 4000 and stats.throughput_bytes_per_s > 0
    assert stats.path.endswith("global_step_5")


async def test_load_by_step_by_path_and_resume_modes(tmp_path, anyio_backend):
    async with CheckpointEngine(tmp_path, layout="megatron", format="dcp") as engine:
        for s in (10, 20):
            await engine.save(s, {"w": torch.full((3,), float(s))})
    engine = CheckpointEngine(tmp_path, layout="megatron", format="dcp")
    assert (tmp_path / "iter_0000010").is_dir() and engine.latest_step() == 20
    t = {"w": torch.zeros(3)}
    assert await engine.load(t, step=10) == 10 and t["w"][0] == 10
    assert await engine.resume(t, "from_path", path=tmp_path / "iter_0000020") == 20
    assert t["w"][0] == 20
    assert await engine.resume(t, "none") is None
    with pytest.raises(FileNotFoundError):
        await engine.load(t, step=30)
    with pytest.raises(ValueError):
        await engine.resume(t, "sideways")
    assert await CheckpointEngine(tmp_path / "empty").load_latest(t) is None


async def test_bad_input_gets_a_clear_error_before_anything_is_written(tmp_path, anyio_backend):
    async with CheckpointEngine(tmp_path) as engine:
        for bad in (-1, "3", 1.0, True, None):
            with pytest.raises((TypeError, ValueError), match="non-negative int"):
                await engine.save(bad, {"w": torch.ones(1)})
        with pytest.raises(TypeError, match="cannot be saved"):
            await engine.save(1, {"w": torch.ones(1), "fn": lambda x: x})
        with pytest.raises(TypeError):
            await engine.save(1, [torch.ones(1)])
        for bad_key in ({1.5: torch.ones(1)}, {"m": {(1, 2): torch.ones(1)}}):
            with pytest.raises(TypeError, match="keys must be str or int"):
                await engine.save(1, bad_key)
        with pytest.raises(TypeError, match="metric"):
            await engine.save(1, {"w": torch.ones(1)}, metrics={"loss": "low"})
        assert not any(n.startswith(("global_step", L.TMP_PREFIX)) for n in os.listdir(tmp_path))
        await (await engine.save(1, {"w": torch.ones(1)})).committed()
        with pytest.raises(CheckpointError, match="already committed"):
            await engine.save(1, {"w": torch.ones(1)})
        with pytest.raises(RootLocked):
            async with CheckpointEngine(tmp_path):
                pass
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(CheckpointError, match="cannot create|not a directory"):
        async with CheckpointEngine(not_a_dir / "sub"):
            pass
    with pytest.raises(ValueError, match="layout"):
        CheckpointEngine(tmp_path, layout="flat")
    with pytest.raises(CheckpointError, match="not started"):
        await CheckpointEngine(tmp_path).save(1, {"w": torch.ones(1)})


async def test_unwritable_root_is_refused(tmp_path, anyio_backend):
    if os.geteuid() == 0:
        # root ignores permissions: use a read-only bind instead of chmod, or skip.
        pytest.skip("running as root: directory permissions do not apply")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="not writable"):
            async with CheckpointEngine(ro):
                pass
    finally:
        ro.chmod(0o755)


def test_a_root_whose_probe_write_fails_is_refused(tmp_path, monkeypatch):
    """The writability probe (LocalStore.check_writable) also where permissions do not apply
    (as root): a write refused by the disk is the same clear error, and no probe is left."""
    from asyncckpt.storage import localfs
    from asyncckpt.trainer.supervisor import lock_root

    def refuse(path, data):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(localfs, "write_synced", refuse)
    with pytest.raises(CheckpointError, match="is not writable: .*Read-only"):
        lock_root(tmp_path / "run", 0, None)
    assert os.listdir(tmp_path / "run") == []


async def test_staging_refuses_rather_than_swap(tmp_path, anyio_backend, monkeypatch):
    import asyncckpt.staging.arenas as staging

    class FakeVM:
        available = 64 << 20

    monkeypatch.setattr(staging.psutil, "virtual_memory", lambda: FakeVM)
    async with CheckpointEngine(tmp_path) as engine:
        with pytest.raises(StagingMemoryError, match="GiB"):
            await engine.save(1, {"w": torch.ones(1000)})
    assert not (tmp_path / "global_step_1").exists()


def test_a_state_over_the_staging_budget_is_refused_before_anything_is_written(tmp_path):
    """``Staging(max_host_bytes=)`` caps every disk slot together: a state whose copies
    (``max_in_flight`` of them) would exceed it fails at its first save, nothing written, and
    a state that fits saves as usual."""
    budget = Staging(max_host_bytes=3 << 20, max_in_flight=2)
    with SyncCheckpointEngine(tmp_path, staging=budget) as engine:
        with pytest.raises(StagingMemoryError, match=r"2 in flight.*max_host_bytes"):
            engine.save(1, {"w": torch.ones(1 << 19)})  # 2 MiB, two copies: 4 MiB > 3 MiB
        assert list(tmp_path.glob("global_step_*")) == []
        engine.save(2, {"w": torch.ones(1 << 18)}).committed_sync(60)  # 1 MiB, 2 copies
        with pytest.raises(StagingMemoryError, match="max_host_bytes"):
            engine.prepare({"w": torch.ones(1 << 20)})
    assert SyncCheckpointEngine(tmp_path).latest_step() == 2


def test_a_staging_budget_the_machine_lacks_is_refused_at_start(tmp_path, monkeypatch):
    from asyncckpt.staging import arenas as staging

    class FakeVM:
        available = 4 << 30

    monkeypatch.setattr(staging.psutil, "virtual_memory", lambda: FakeVM)
    engine = SyncCheckpointEngine(tmp_path, staging=Staging(max_host_bytes=8 << 30))
    with pytest.raises(StagingMemoryError, match="GiB"):
        engine.__enter__()
    assert engine.worker_pid is None


def test_sync_facade(tmp_path):
    state = {"w": torch.arange(5.0)}
    with SyncCheckpointEngine(tmp_path) as engine:
        h = engine.save(1, state)
        state["w"].add_(1)
        assert h.committed_sync(60).step == 1
        engine.save(2, state)
        engine.wait()
        assert engine.latest_step() == 2
    t = {"w": torch.zeros(5)}
    assert SyncCheckpointEngine(tmp_path).load(t, step=1) == 1
    assert torch.equal(t["w"], torch.arange(5.0))


def test_leaving_the_block_on_an_exception_still_commits_staged_saves(tmp_path):
    faults.inject("before_shard_write", "delay:0.5")
    with pytest.raises(RuntimeError, match="boom"):
        with SyncCheckpointEngine(tmp_path) as engine:
            engine.save(1, {"w": torch.ones(3)})
            raise RuntimeError("boom")
    assert (tmp_path / "global_step_1").is_dir() and L.read_tracker(tmp_path) == 1


def test_sigterm_waits_for_staged_saves_to_commit(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from asyncckpt import SyncCheckpointEngine, faults
        faults.inject("before_shard_write", "delay:1.0")
        with SyncCheckpointEngine({str(tmp_path)!r}) as engine:
            engine.save(1, {{"w": torch.ones(3)}})
            os.kill(os.getpid(), signal.SIGTERM)
            print("not reached")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == -signal.SIGTERM, out.stderr
    assert "not reached" not in out.stdout
    assert (tmp_path / "global_step_1").is_dir() and L.read_tracker(tmp_path) == 1


def test_preemption_save_after_sigterm(tmp_path):
    # Preemption(final_save=True): SIGTERM drains, then should_save answers yes once so the loop
    # writes a final checkpoint and stops by itself.
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from asyncckpt import Preemption, Schedule, SyncCheckpointEngine
        state = {{"w": torch.zeros(3)}}
        with SyncCheckpointEngine({str(tmp_path)!r}, schedule=Schedule(every_steps=100),
                                  preemption=Preemption(final_save=True)) as engine:
            for step in range(1, 1000):
                state["w"].fill_(step)
                if step == 7:
                    os.kill(os.getpid(), signal.SIGTERM)
                if engine.should_save(step):
                    engine.save(step, state)
                    print("saved", step)
                if engine.preempted:
                    break
        print("exited at", step)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "saved 7" in out.stdout and "exited at 7" in out.stdout
    assert L.read_tracker(tmp_path) == 7


# ------------------------------------------------------------------ issue 28 item 10: fds


def _fd_counts(root, cycles: int) -> list[int]:
    """Open files of this process after each open/save/close cycle, both facades in turn,
    with the garbage collector off: what close() frees, not what a collection would."""
    import gc

    import anyio

    from asyncckpt import KeepLast

    state = {"x": torch.zeros(1)}

    async def async_cycle(step: int) -> None:
        async with CheckpointEngine(
            root, keep=KeepLast(1), preemption=Preemption(handle_sigterm=False)
        ) as engine:
            await engine.save(step, state)

    def cycle(step: int) -> None:
        if step % 2:
            with SyncCheckpointEngine(
                root, keep=KeepLast(1), preemption=Preemption(handle_sigterm=False)
            ) as engine:
                engine.save(step, state)
                pid = engine.worker_pid
            assert engine.worker_pid == pid  # still known once closed
        else:
            anyio.run(async_cycle, step)

    counts = []
    gc.collect()
    gc.disable()
    try:
        cycle(1)  # warm: what the first engine of a process opens once
        for step in range(2, 2 + cycles):
            cycle(step)
            counts.append(len(os.listdir("/proc/self/fd")))
    finally:
        gc.enable()
    return counts


def test_a_closed_engine_frees_its_file_descriptors(tmp_path):
    counts = _fd_counts(tmp_path, 3)
    assert counts == [counts[0]] * len(counts), counts


@pytest.mark.torture  # a soak: 9 minutes (three cycles run in the quick suite)
def test_a_hundred_open_close_cycles_leave_the_fd_count_flat(tmp_path):
    counts = _fd_counts(tmp_path, 100)
    assert counts == [counts[0]] * len(counts), counts
