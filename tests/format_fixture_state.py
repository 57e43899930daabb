"""The states saved into tests/fixtures/format_v1 (by scripts/make_format_fixture.py): the
fixture test rebuilds them to compare what it loads bit for bit."""

from __future__ import annotations

import torch


def fixture_state(step: int) -> dict:
    """The state saved at ``step``; tests/formats/test_format_fixture.py rebuilds it to compare."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=g),
            "b16": torch.randn(5, generator=g).to(torch.bfloat16),
            "i": torch.arange(6, dtype=torch.int64).reshape(2, 3) + step,
            "flag": torch.tensor(step % 2 == 0),
        },
        "optim": {"state": {0: {"exp_avg": torch.randn(3, generator=g)}}, "lr": 0.1 * step},
        "progress": {"step": step, "name": f"run-{step}"},
    }
