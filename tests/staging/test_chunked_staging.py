"""A state larger than ``Staging(max_host_bytes=)`` is staged in chunks (chunked.py): the
checkpoint is a plain DCP checkpoint, loaded bit for bit by asyncckpt and by ``dcp.load``, a
tensor larger than the budget is staged in slices, and a failure or a trainer's death before
the last chunk is copied commits nothing (the previous step stays the newest)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from statecmp import assert_same
from test_flush_on_death import wait_gone

from asyncckpt import Staging, SyncCheckpointEngine, ThrottleConfig, faults
from asyncckpt.errors import SaveFailed, StagingMemoryError, StateModifiedWhileStaging

MiB = 1 << 20


def make_state(step: int) -> dict:
    """About 3 MiB over eight tensors of several dtypes and shapes, one object leaf."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "emb": torch.randn(256, 1024, generator=g),  # 1 MiB
            "w": torch.randn(512, 512, generator=g).to(torch.bfloat16),  # 0.5 MiB
            "b": torch.randn(7, generator=g),
            "scalar": torch.tensor(float(step)),
            "empty": torch.empty(0, 4),
        },
        "opt": {
            "m": torch.randn(1000, 250, generator=g),  # ~1 MiB
            "ids": torch.randint(0, 1 << 40, (3000, 3), generator=g),
        },
        "step": step,
    }


def nbytes(state: dict) -> int:
    out = 0
    for v in state.values():
        if isinstance(v, dict):
            out += nbytes(v)
        elif isinstance(v, torch.Tensor):
            out += v.numel() * v.element_size()
    return out


def blank(state: dict) -> dict:
    return {
        k: blank(v)
        if isinstance(v, dict)
        else torch.zeros_like(v)
        if isinstance(v, torch.Tensor)
        else -1
        for k, v in state.items()
    }


def step_dir(root, step: int):
    return root / f"global_step_{step}"


PLAIN_LOAD = """
import sys, torch, torch.distributed.checkpoint as dcp
def blank(x):
    if isinstance(x, dict):
        return {k: blank(v) for k, v in x.items()}
    return torch.zeros_like(x) if isinstance(x, torch.Tensor) else -1
def same(a, b, where):
    if isinstance(b, dict):
        for k in b:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    else:
        assert a == b, where
state = torch.load(sys.argv[2])
target = blank(state)
dcp.load(target, checkpoint_id=sys.argv[1])
assert not any(m.startswith("asyncckpt") for m in sys.modules)
same(target, state, "")
print("ok")
"""


def plain_dcp_load(tmp_path, directory, state: dict) -> None:
    """``dcp.load`` in a process that never imports asyncckpt, compared byte for byte."""
    torch.save(state, tmp_path / "expected.pt")
    script = tmp_path / "plain_load.py"
    script.write_text(PLAIN_LOAD)
    out = subprocess.run(
        [sys.executable, str(script), str(directory), str(tmp_path / "expected.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_a_state_over_the_budget_is_saved_in_chunks_and_loads_bit_for_bit(tmp_path, fraction):
    state = make_state(1)
    budget = int(nbytes(state) * fraction) + 4096  # (the whole state's arena, aligned)
    root = tmp_path / "r"
    throttle = ThrottleConfig.background(io_threads=3)
    with SyncCheckpointEngine(
        root, staging=Staging(max_host_bytes=budget), throttle=throttle
    ) as engine:
        stats = engine.save(1, state).committed_sync(120)
        state2 = make_state(2)
        stats2 = engine.save(2, state2).committed_sync(120)  # the buffers, reused
    if fraction == 1.0:
        assert stats.chunks == 0 and stats2.chunks == 0  # fits: staged whole
        # 3 asked; one writer per shard file, and this state packs into fewer than 3
        files = len(list(step_dir(root, 2).glob("*.distcp")))
        assert stats.io_threads == stats2.io_threads == min(3, files)
    else:
        assert stats.chunks >= 2 / fraction and stats2.chunks == stats.chunks
        assert stats.io_threads == stats2.io_threads == 1  # one file, chunk by chunk
        assert [p.name for p in step_dir(root, 2).glob("*.distcp")] == ["__0_0.distcp"]
    target = blank(state2)
    with SyncCheckpointEngine(root) as engine:
        assert engine.load_latest(target) == 2
    assert_same(target, state2)
    target = blank(state)
    dcp.load(target, checkpoint_id=str(step_dir(root, 1)))
    assert_same(
        {k: v for k, v in target.items() if k != "step"},
        {k: v for k, v in state.items() if k != "step"},
    )
    if fraction == 0.25:
        plain_dcp_load(tmp_path, step_dir(root, 2), state2)


def test_a_tensor_larger_than_the_budget_is_staged_in_slices(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"huge": torch.randn(2048, 513, generator=g), "small": torch.arange(10)}  # 4 MiB
    root = tmp_path / "r"
    with SyncCheckpointEngine(root, staging=Staging(max_host_bytes=1 * MiB)) as engine:
        stats = engine.save(1, state).committed_sync(120)
    assert stats.chunks >= 8  # two buffers of 0.5 MiB each
    md = dcp.FileSystemReader(str(step_dir(root, 1))).read_metadata()
    chunks = md.state_dict_metadata["huge"].chunks
    assert len(chunks) >= 8 and sum(c.sizes[0] for c in chunks) == 2048  # slices of rows
    files = {md.storage_data[i].relative_path for i in md.storage_data if i.fqn == "huge"}
    assert files == {"__0_0.distcp"}  # every slice in the one shard file
    plain_dcp_load(tmp_path, step_dir(root, 1), state)
    target = {"huge": torch.zeros(2048, 513), "small": torch.zeros(10, dtype=torch.long)}
    with SyncCheckpointEngine(root) as engine:
        assert engine.load_latest(target) == 1
    assert_same(target, state)


def test_a_row_larger_than_a_chunk_is_refused_before_anything_is_written(tmp_path):
    root = tmp_path / "r"
    with SyncCheckpointEngine(root, staging=Staging(max_host_bytes=64 << 10)) as engine:
        with pytest.raises(StagingMemoryError, match="row"):
            engine.save(1, {"w": torch.zeros(2, 1 << 14)})  # a row of 64 KiB
    assert not step_dir(root, 1).exists()


def test_a_write_failure_mid_chunks_leaves_the_previous_step_newest(tmp_path):
    root = tmp_path / "r"
    budget = Staging(max_host_bytes=nbytes(make_state(1)) // 3)
    with SyncCheckpointEngine(root, staging=budget) as engine:
        engine.save(1, make_state(1)).committed_sync(120)
        faults.inject("mid_chunk_write", "eio", after=1)  # after the 2nd chunk is written
        try:
            handle = engine.save(2, make_state(2))
            with pytest.raises(SaveFailed, match="I/O|EIO|Input/output"):
                handle.committed_sync(120)
        finally:
            faults.clear()
        assert engine.latest_step() == 1
        engine.save(3, make_state(3)).committed_sync(120)  # the engine goes on
    assert not step_dir(root, 2).exists()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("global_step")) == [
        "global_step_1",
        "global_step_3",
    ]


def test_a_trainer_error_between_chunks_commits_nothing(tmp_path):
    """``save()`` raised after the first chunks were handed over: the worker must not wait
    for the rest, nor commit what it has."""
    root = tmp_path / "r"
    budget = Staging(max_host_bytes=nbytes(make_state(1)) // 3)
    with SyncCheckpointEngine(root, staging=budget) as engine:
        engine.save(1, make_state(1)).committed_sync(120)
        faults.inject("between_chunks", "raise", after=1)
        try:
            with pytest.raises(RuntimeError):
                engine.save(2, make_state(2))
        finally:
            faults.clear()
        engine.save(3, make_state(3)).committed_sync(120)
        assert engine.latest_step() == 3
    assert not step_dir(root, 2).exists()
    target = blank(make_state(3))
    with SyncCheckpointEngine(root) as engine:
        assert engine.load_latest(target) == 3
    assert_same(target, make_state(3))


def test_a_state_modified_while_its_chunks_are_copied_fails_the_save(tmp_path):
    root = tmp_path / "r"
    state = make_state(2)
    budget = Staging(max_host_bytes=nbytes(state) // 3)
    with SyncCheckpointEngine(root, staging=budget) as engine:
        engine.save(1, make_state(1)).committed_sync(120)
        # Another thread's in-place write while save() copies (here: at a fault point).
        faults.inject("between_chunks", "delay:0.01")
        import threading

        stop = threading.Event()

        def mutate() -> None:
            while not stop.is_set():
                state["model"]["b"].add_(1.0)
                stop.wait(0.001)

        t = threading.Thread(target=mutate)
        t.start()
        try:
            handle = engine.save(2, state)
        finally:
            stop.set()
            t.join()
            faults.clear()
        with pytest.raises(SaveFailed, match="changed while it was staged"):
            handle.committed_sync(120)
        assert engine.latest_step() == 1
    assert not step_dir(root, 2).exists()


def test_overlap_refuses_a_state_over_the_budget(tmp_path):
    root = tmp_path / "r"
    budget = Staging(max_host_bytes=nbytes(make_state(1)) // 3)
    with SyncCheckpointEngine(root, staging=budget) as engine:
        with pytest.raises(StagingMemoryError, match="overlap"):
            engine.save(1, make_state(1), overlap=True)
        engine.prepare(make_state(1))  # the chunk buffers: within the budget
        engine.save(2, make_state(2)).committed_sync(120)
    assert not step_dir(root, 1).exists()


TRAINER = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_chunked_staging import make_state, nbytes
from asyncckpt import Staging, SyncCheckpointEngine, faults
engine = SyncCheckpointEngine(sys.argv[1], staging=Staging(max_host_bytes=nbytes(make_state(1)) // 3))
engine.__enter__()  # never left: the trainer dies inside
engine.save(1, make_state(1)).committed_sync()
print(engine.worker_pid, flush=True)
faults.inject("between_chunks", "kill", after=1)  # two chunks handed over, then SIGKILL
engine.save(2, make_state(2))
print("not reached", flush=True)
"""


def test_a_trainer_killed_mid_chunks_leaves_no_torn_step(tmp_path):
    root = tmp_path / "r"
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER))
    tests_dir = str(__import__("pathlib").Path(__file__).parents[1])
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run(
            [sys.executable, str(script), str(root), tests_dir],
            stdout=out,
            stderr=err,
            timeout=300,
        )
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "err").read_text()
    lines = (tmp_path / "out").read_text().split()
    assert "not" not in lines
    wait_gone(int(lines[-1]), 120)  # the orphaned worker gives the save up and exits
    assert not step_dir(root, 2).exists()
    assert not [p for p in root.iterdir() if "tmp" in p.name and "global_step_2" in p.name]
    target = blank(make_state(1))
    with SyncCheckpointEngine(root) as engine:
        assert engine.load_latest(target) == 1
    assert_same(target, make_state(1))
    assert not [p for p in root.iterdir() if p.name.startswith(".") and "tmp" in p.name]


# ------------------------------------------------------------------ writes no counter sees
def at_chunk(monkeypatch, number: int, write) -> None:
    """Run ``write`` from another thread at the ``number``-th ``between_chunks`` point: the
    chunks before it are copied (and handed to the worker), the later ones are not."""
    real = faults.point
    seen = [0]

    def point(name: str) -> None:
        if name == "between_chunks":
            seen[0] += 1
            if seen[0] == number:
                t = threading.Thread(target=write)
                t.start()
                t.join()
        real(name)

    monkeypatch.setattr(faults, "point", point)


def sliced_state() -> dict:
    """Under a 1 MiB budget (chunks of 0.5 MiB): ``strided`` alone in chunk 1, ``huge`` (2 MiB)
    in slices over chunks 2-6, the rest with its last slice in chunk 6."""
    g = torch.Generator().manual_seed(0)
    return {
        "strided": torch.randn(300, 200, generator=g).t(),
        "huge": torch.randn(2048, 256, generator=g),
        "tail": torch.randn(64, 256, generator=g),
        "small": torch.arange(10.0),
    }


@pytest.mark.parametrize(
    "write",
    [
        lambda t: t.data[0].add_(1.0),  # .data: its own counter (an RL weight sync's write)
        lambda t: t.detach().numpy()[0, :4].__iadd__(1.0),  # through NumPy: no counter
    ],
    ids=["data", "numpy"],
)
def test_a_write_no_counter_sees_between_chunks_fails_the_save(tmp_path, monkeypatch, write):
    """Another thread writes a slice already copied (and handed to the worker) while the
    later chunks are still to be copied, where no version counter moves: the checkpoint would
    hold that slice from before the write and the rest from after. The compare of each
    staged piece with its source once the last chunk is copied sees it: the save fails naming
    the tensor, nothing is committed, the previous step stays the newest."""
    root = tmp_path / "r"
    state = sliced_state()
    with SyncCheckpointEngine(root, staging=Staging(max_host_bytes=1 * MiB)) as engine:
        engine.save(1, sliced_state()).committed_sync(120)
        at_chunk(monkeypatch, 2, lambda: write(state["huge"]))  # its first slice copied
        handle = engine.save(2, state)
        with pytest.raises(SaveFailed, match="changed while it was staged") as info:
            handle.committed_sync(120)
        assert engine.latest_step() == 1
        torn = info.value.__cause__
        assert isinstance(torn, StateModifiedWhileStaging), info.value
        assert torn.unseen == torn.keys == ["huge"], torn
        assert "no version counter moved" in str(info.value)
        engine.save(3, sliced_state()).committed_sync(120)  # the engine goes on
    assert not step_dir(root, 2).exists()
    target = blank(sliced_state())
    with SyncCheckpointEngine(root) as engine:
        assert engine.load_latest(target) == 3
    assert_same(target, sliced_state())


def test_a_strided_tensor_written_after_its_chunk_fails_the_save(tmp_path, monkeypatch):
    """A strided source (staged by torch's copy) is compared from its rows' bytes."""
    root = tmp_path / "r"
    state = sliced_state()
    with SyncCheckpointEngine(root, staging=Staging(max_host_bytes=1 * MiB)) as engine:
        assert engine.save(1, sliced_state()).committed_sync(120).chunks == 6
        at_chunk(monkeypatch, 1, lambda: state["strided"].data[5, 7].fill_(1e9))
        with pytest.raises(SaveFailed) as info:
            engine.save(2, state).committed_sync(120)
        assert engine.latest_step() == 1
    assert info.value.__cause__.unseen == ["strided"], info.value


def test_a_write_to_a_chunk_not_yet_copied_is_saved_as_of_the_end(tmp_path, monkeypatch):
    """A write through ``.data`` to a tensor whose chunk is still to be copied lands in the
    checkpoint with the other tensors as they were: one instant, the end of the last chunk's
    copy; the compare's time is reported."""
    root = tmp_path / "r"
    state = sliced_state()
    at_chunk(monkeypatch, 1, lambda: state["tail"].data.fill_(7.0))
    with SyncCheckpointEngine(root, staging=Staging(max_host_bytes=1 * MiB)) as engine:
        stats = engine.save(1, state).committed_sync(120)
    assert stats.chunks == 6 and stats.copy_check_seconds > 0
    want = sliced_state()
    want["tail"].fill_(7.0)
    target = blank(want)
    with SyncCheckpointEngine(root) as engine:
        assert engine.load_latest(target) == 1
    assert_same(target, want)
