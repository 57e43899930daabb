"""The CPU staging copy: exact bytes whether one thread or a pool copies, for any mix of sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncckpt import staging


@pytest.mark.parametrize("threads", [1, 3])
def test_copy_cpu_copies_every_byte(monkeypatch, threads: int) -> None:
    monkeypatch.setattr(staging, "_COPY_CHUNK", 1000)  # many slices and batches
    monkeypatch.setattr(staging, "CPU_COPY_THREADS", threads)
    monkeypatch.delenv("ASYNCCKPT_COPY_THREADS", raising=False)
    rng = np.random.default_rng(threads)
    sizes = [1, 7, 999, 1000, 1001, 4321, 10, 0, 25_000, 3]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.zeros(n, dtype=np.uint8) for n in sizes]
    staging._copy_cpu([(d, s) for d, s in zip(dsts, srcs, strict=True) if len(s)])
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
