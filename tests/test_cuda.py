"""The same guarantees with CUDA tensors: pinned arenas, side-stream copies (skips without CUDA)."""

from __future__ import annotations

import pytest
import torch

from asyncckpt import CheckpointEngine, faults

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_cuda_round_trip_and_mutation_after_save(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "w": torch.randn(1024, 1024, device="cuda", generator=g),
        "h": torch.randn(333, device="cuda", generator=g).half(),
        "b": torch.randn(64, device="cuda", generator=g).bfloat16(),
        "mask": torch.randn(77, device="cuda", generator=g) > 0,
        "cpu_opt": torch.randn(1000),
    }
    expected = {k: v.clone() for k, v in state.items()}
    faults.inject("before_shard_write", "delay:0.5")
    async with CheckpointEngine(tmp_path) as engine:
        await engine.prepare(state)
        assert engine._core.slots[0].pinned
        handle = await engine.save(1, state)
        for t in state.values():
            t.zero_() if t.dtype != torch.bool else t.logical_not_()
        await handle.committed()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    assert await CheckpointEngine(tmp_path).load_latest(target) == 1
    for k in expected:
        assert target[k].device == expected[k].device
        assert torch.equal(target[k], expected[k]), k
