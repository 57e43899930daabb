"""A save leaves the caller's tensors as they were: values, dtype, device, shape, strides,
storage and its flags. torch marks a storage exported to NumPy (``Tensor.numpy()``)
non-resizable for good, so a staging copy that read the caller's tensors that way broke
``t.resize_()`` and ``t.untyped_storage().resize_(0)`` (how FSDP-style code frees a storage)
in the user's own code, steps later. Plain ``dcp.save`` leaves them resizable; so must every
kind of save here: to disk, to the memory tier, differential, in chunks, overlapped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from asyncckpt import MemoryTier, Staging, SyncCheckpointEngine

MiB = 1 << 20


def make_state() -> dict:
    """Large tensors (copied as bytes by the copy pool), small ones (copied by torch), a
    strided and a non-contiguous one, a conjugate view's source and a 4 MiB one."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "big": torch.randn(1024, 1024, generator=g),  # 4 MiB
            "wide": torch.randn(512, 1024, generator=g).to(torch.bfloat16),  # 1 MiB
            "t": torch.randn(1024, 300, generator=g).t(),  # strided, ~1.2 MiB
            "small": torch.randn(33, generator=g),
            "ids": torch.arange(1000),
            "scalar": torch.tensor(3.5),
        },
        "opt": {"m": torch.randn(300, 1000, generator=g)},
        "step": 1,
    }


def tensors_of(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(tensors_of(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def record(t: torch.Tensor) -> tuple:
    """What a save must not change of a tensor (its values compared apart, bit for bit)."""
    s = t.untyped_storage()
    return (
        t.dtype,
        t.device,
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        s.data_ptr(),
        s.nbytes(),
        s.resizable(),
        t.requires_grad,
        t.is_conj(),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def disk() -> tuple[dict, Callable]:
    return {"staging": Staging(differential=False)}, lambda e, s, st: e.save(s, st)


def differential() -> tuple[dict, Callable]:
    # The second save fingerprints the sources to skip copying the unchanged ones.
    return {"staging": Staging(differential=True)}, lambda e, s, st: e.save(s, st)


def memory() -> tuple[dict, Callable]:
    return {"memory": MemoryTier(persist_on_close=True)}, lambda e, s, st: e.save(
        s, st, tier="memory"
    )


def chunked() -> tuple[dict, Callable]:
    return {"staging": Staging(max_host_bytes=3 * MiB)}, lambda e, s, st: e.save(s, st)


def overlapped() -> tuple[dict, Callable]:
    # The copy runs behind the caller; its byte check reads the sources again after it.
    return {}, lambda e, s, st: e.save(s, st, overlap=True)


@pytest.mark.parametrize(
    "kind", [disk, differential, memory, chunked, overlapped], ids=lambda f: f.__name__
)
def test_every_kind_of_save_leaves_the_callers_tensors_as_they_were(tmp_path, kind):
    state = make_state()
    tensors = tensors_of(state)
    before = {k: (record(t), bits(t)) for k, t in tensors.items()}
    assert all(r[7] for r, _ in before.values())  # resizable to begin with
    options, save = kind()
    with SyncCheckpointEngine(tmp_path / "r", keep=None, **options) as engine:
        for step in (1, 2, 3):
            handle = save(engine, step, state)
            if kind is not memory:
                stats = handle.committed_sync(120)
                if kind is chunked:
                    assert stats.chunks >= 2  # really staged in chunks
            else:
                handle.staged_sync()
    for k, t in tensors.items():
        assert record(t) == before[k][0], k
        assert torch.equal(bits(t), before[k][1]), k
    # What the user's code does with them afterwards, as it could before any save.
    for k, t in tensors.items():
        n = t.numel()
        t.resize_(2 * n)
        assert t.numel() == 2 * n, k
        t.untyped_storage().resize_(0)
        assert t.untyped_storage().nbytes() == 0, k
