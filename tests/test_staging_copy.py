"""The CPU staging copy: exact bytes whether one thread or a pool copies, for any mix of sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncckpt import staging


@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_copier_copies_every_byte(monkeypatch, threads: int) -> None:
    monkeypatch.setattr(staging, "_COPY_CHUNK", 1000)  # many slices and batches
    monkeypatch.setattr(staging, "CPU_COPY_THREADS", threads)
    monkeypatch.delenv("ASYNCCKPT_COPY_THREADS", raising=False)
    rng = np.random.default_rng(threads)
    sizes = [1, 7, 999, 1000, 1001, 4321, 10, 0, 25_000, 3]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n, dtype=np.uint8) for n in sizes]
    with staging._CpuCopier(staging.cpu_copy_threads()) as copier:
        for d, s in zip(dsts, srcs, strict=True):
            if len(s):
                copier.add(d, s)
    for d, s in zip(dsts, srcs, strict=True):
        assert np.array_equal(d, s)


def test_copy_threads_follow_the_trainers_torch_threads(monkeypatch) -> None:
    monkeypatch.setattr(staging, "CPU_COPY_THREADS", None)
    monkeypatch.delenv("ASYNCCKPT_COPY_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert staging.cpu_copy_threads() == 1
        monkeypatch.setenv("ASYNCCKPT_COPY_THREADS", "3")
        assert staging.cpu_copy_threads() == 3  # the environment wins
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_slot_copies_every_dtype_and_shape(monkeypatch, threads: int) -> None:
    # The arena's byte views are computed once per layout; every dtype, 0-d, empty and
    # non-contiguous source must still land byte for byte, save after save.
    monkeypatch.setattr(staging, "_COPY_CHUNK", 512)
    monkeypatch.setattr(staging, "CPU_COPY_THREADS", threads)
    monkeypatch.delenv("ASYNCCKPT_COPY_THREADS", raising=False)
    g = torch.Generator().manual_seed(threads)
    tensors = {
        "f32": torch.randn(300, 7, generator=g),
        "bf16": torch.randn(33, generator=g).bfloat16(),
        "f16": torch.randn(5, 5, generator=g).half(),
        "i64": torch.randint(-100, 100, (129,), generator=g),
        "u8": torch.randint(0, 255, (1000,), generator=g, dtype=torch.uint8),
        "bool": torch.randint(0, 2, (17,), generator=g).bool(),
        "c64": torch.randn(9, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(40, 30, generator=g).t(),
    }
    slot = staging.StagingSlot(0)
    slot.ensure(tensors, pin=False)
    for _ in range(2):
        for t in tensors.values():
            if t.numel() and t.dtype.is_floating_point:
                t.add_(1)
        slot.copy_in(tensors)
        for view, (name, t) in zip(slot.views, tensors.items(), strict=True):
            assert view.dtype == t.dtype and view.shape == t.shape, name
            assert torch.equal(view, t), name
    slot.release()


def test_copier_waits_for_its_tasks_when_the_walk_fails(monkeypatch) -> None:
    import time

    real_copy = staging._copy_batch

    def slow_copy(batch):
        time.sleep(0.05)  # still copying when the walk fails, unless waited for
        real_copy(batch)

    monkeypatch.setattr(staging, "_copy_batch", slow_copy)
    monkeypatch.setattr(staging, "_COPY_CHUNK", 1 << 12)
    src = np.arange(1 << 14, dtype=np.uint8)
    dst = np.zeros_like(src)
    copier = staging._CpuCopier(2)
    with pytest.raises(RuntimeError, match="walk failed"):
        with copier:
            copier.add(dst, src)
            raise RuntimeError("walk failed")
    assert len(copier.futures) == 4 and all(f.done() for f in copier.futures)
    assert np.array_equal(dst, src)
