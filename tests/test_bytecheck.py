"""bytecheck.changed_since_copied: the compare of a slot's staged bytes with the sources',
which overlapped saves run after their copy (a write through ``.data`` or NumPy moves no
version counter). Exact on bytes: NaNs equal themselves, -0.0 differs from 0.0."""

from __future__ import annotations

import pytest
import torch

from asyncckpt import bytecheck
from asyncckpt.staging import StagingSlot


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"small{i}": torch.randn(64, generator=g) for i in range(300)}
    out["big"] = torch.randn(1 << 19, generator=g)  # 2 MiB: a large tensor
    out["nan"] = torch.full((8,), float("nan"))
    out["strided"] = torch.randn(16, 16, generator=g).t()  # copied from a strided source
    out["half"] = torch.randn(33, generator=g).to(torch.bfloat16)
    out["empty"] = torch.empty(0, 3)
    return out


def _staged(tensors: dict[str, torch.Tensor]) -> StagingSlot:
    slot = StagingSlot(0)
    slot.ensure(tensors, pin=False)
    slot.copy_in(tensors, any_cuda=False)
    return slot


def test_nothing_changed_nothing_named():
    tensors = _state()
    slot = _staged(tensors)
    assert bytecheck.changed_since_copied(slot, tensors) == []
    assert bytecheck.changed_since_copied(slot, tensors) == []  # the packing kept, reused


@pytest.mark.parametrize(
    "key, write",
    [
        ("small7", lambda t: t.data.add_(1.0)),
        ("small299", lambda t: t.detach().numpy().__setitem__(3, 9.0)),
        ("big", lambda t: t.data[-1:].fill_(1e9)),
        ("strided", lambda t: t.data.mul_(2.0)),
        ("half", lambda t: t.data.neg_()),
        ("nan", lambda t: t.data.fill_(-0.0)),
    ],
)
def test_a_write_after_the_copy_is_named(key, write):
    tensors = _state()
    slot = _staged(tensors)
    write(tensors[key])
    assert bytecheck.changed_since_copied(slot, tensors) == [key]


def test_minus_zero_is_not_zero_and_the_names_come_in_state_order():
    tensors = _state()
    tensors["small3"].zero_()
    slot = _staged(tensors)
    tensors["small3"].data.neg_()  # 0.0 -> -0.0: equal as floats, not as bytes
    tensors["small1"].data.add_(1.0)
    assert bytecheck.changed_since_copied(slot, tensors) == ["small1", "small3"]


def test_small_tensors_beyond_the_packing_cap_are_compared_one_by_one(monkeypatch, caplog):
    monkeypatch.setattr(bytecheck, "PACK_MAX_BYTES", 64 * 4 * 10)  # ten small tensors packed
    monkeypatch.setattr(bytecheck, "_said_unpacked", False)
    tensors = _state()
    slot = _staged(tensors)
    tensors["small2"].data.add_(1.0)  # packed
    tensors["small250"].data.add_(1.0)  # one by one
    with caplog.at_level("INFO", logger="asyncckpt"):
        assert bytecheck.changed_since_copied(slot, tensors) == ["small2", "small250"]
    assert "compares 293 small tensors one by one" in caplog.text, caplog.text


def test_a_new_layout_packs_anew():
    tensors = _state()
    slot = _staged(tensors)
    bytecheck.changed_since_copied(slot, tensors)
    first = slot.byte_check
    more = dict(tensors, extra=torch.ones(5))
    slot.ensure(more, pin=False)
    slot.copy_in(more, any_cuda=False)
    assert slot.byte_check is None  # dropped with the old layout's arenas
    more["extra"].data.add_(1.0)
    assert bytecheck.changed_since_copied(slot, more) == ["extra"]
    assert slot.byte_check is not first
