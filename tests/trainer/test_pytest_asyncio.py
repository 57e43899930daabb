"""The engine under pytest-asyncio's own event loop (the other tests use anyio's plugin)."""

import pytest
import torch

from asyncckpt import CheckpointEngine


@pytest.mark.asyncio
async def test_save_and_load_under_pytest_asyncio(tmp_path):
    async with CheckpointEngine(tmp_path) as engine:
        stats = await (await engine.save(1, {"w": torch.arange(4.0)})).committed()
    assert stats.step == 1 and (tmp_path / "global_step_1").is_dir()
    target = {"w": torch.zeros(4)}
    assert await CheckpointEngine(tmp_path).load_latest(target) == 1
    assert torch.equal(target["w"], torch.arange(4.0))
