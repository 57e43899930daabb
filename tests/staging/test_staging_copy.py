"""The CPU staging copy: exact bytes whether one thread or a pool copies, for any mix of sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncckpt.staging import arenas as staging


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


class _Device:
    """A stand-in that says whether it is on a GPU and counts how often it was asked."""

    asked = 0

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda

    @property
    def is_cuda(self) -> bool:
        _Device.asked += 1
        return self._cuda


def test_any_cuda_asks_no_tensor_where_cuda_was_never_initialised(monkeypatch) -> None:
    # The per-save device pass (2 ms at 20,000 tensors) is skipped only where no tensor can be
    # on a GPU; where CUDA is initialised every tensor is asked until one is.
    _Device.asked = 0
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert staging.any_cuda([_Device(False), _Device(False)]) is False
    assert _Device.asked == 0
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert staging.any_cuda([_Device(False), _Device(True), _Device(False)]) is True
    assert _Device.asked == 2
    assert staging.any_cuda([_Device(False), _Device(False)]) is False


def test_a_cpu_state_is_staged_into_unpinned_arenas_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only process")
    t = {"a": torch.arange(4.0), "b": torch.ones(3, dtype=torch.int64)}
    assert not torch.cuda.is_initialized() and staging.any_cuda(t.values()) is False
    slot = staging.StagingSlot(0)
    slot.ensure(t, staging.any_cuda(t.values()))
    slot.copy_in(t)
    assert not slot.pinned
    assert all(torch.equal(v, t[k]) for k, v in zip(t, slot.views, strict=True))
    slot.release()


def test_same_key_compares_equal_keys_and_knows_one_key_at_once() -> None:
    from asyncckpt.core.cachekeys import arena_key, same_key

    a = arena_key({"x": torch.zeros(2), "y": torch.zeros(3, dtype=torch.int8)})
    b = arena_key({"x": torch.zeros(2), "y": torch.zeros(3, dtype=torch.int8)})
    c = arena_key({"x": torch.zeros(2), "y": torch.zeros(3, dtype=torch.int16)})
    assert same_key(a, a) and same_key(a, b) and not same_key(a, c)
    assert not same_key(None, a) and same_key(None, None)
