"""One comparison of saved and loaded states for every test module (and the helper scripts
that run with no asyncckpt imported: it imports torch and numpy only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def assert_same(got: Any, want: Any, path: str = "state") -> None:
    """Recursive equality: same container types and keys, tensors bit for bit (NaN, -0.0),
    dtype and shape included; numpy arrays element for element."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, set(got) ^ set(want))
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (path, got, want)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}.{i}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (path, type(got))
        assert (got.dtype, got.shape) == (want.dtype, want.shape), (path, got, want)
        assert torch.equal(_bits(got), _bits(want)), (path, got, want)
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and np.array_equal(got, want), path
    else:
        assert got == want, (path, got, want)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
