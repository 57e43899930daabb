"""bytecheck.changed_since_copied: the compare of a slot's staged bytes with the sources',
which overlapped saves run after their copy (a write through ``.data`` or NumPy moves no
version counter). Exact on bytes: NaNs equal themselves, -0.0 differs from 0.0."""

from __future__ import annotations

import pytest
import torch

from asyncckpt.staging import bytecheck
from asyncckpt.staging.arenas import StagingSlot


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


# ------------------------------------------------------------------ found in review
def test_a_storage_freed_after_the_copy_is_never_read_by_the_compare():
    """The loop frees a storage (FSDP: ``untyped_storage().resize_(0)``) between the copy and
    the compare: the compare read it through a null pointer (the trainer died, SIGSEGV). Now
    the pointers are checked first, as the copy does: a torn state naming it."""
    from asyncckpt.errors import StateModifiedWhileStaging
    from asyncckpt.staging.arenas import Marks

    frees = {
        "small5": lambda t: t.untyped_storage().resize_(0),
        # (a large one is read through its pointer, not t.numpy(): it stays resizable)
        "big": lambda t: t.untyped_storage().resize_(0),
        "strided": lambda t: t.set_(torch.zeros(3)),
    }
    for key, free in frees.items():
        tensors = _state()
        marks = Marks.of(tensors)
        slot = _staged(tensors)
        free(tensors[key])
        with pytest.raises(StateModifiedWhileStaging) as info:
            bytecheck.changed_since_copied(slot, tensors, marks)
        assert info.value.storage == [key]


def test_an_in_place_write_after_the_copy_is_named_as_one(tmp_path, monkeypatch):
    """A write the version counter sees, landing after the copy's counter check and before
    the compare: the save fails (its bytes are not the staged ones) and says what it was, not
    "no version counter moved"."""
    from asyncckpt import SaveFailed, StateModifiedWhileStaging, SyncCheckpointEngine
    from asyncckpt.staging import unchanged

    state = {"w": torch.randn(256), "b": torch.randn(256)}
    real = unchanged.torn_since
    calls = []

    def then_write(tensors, marks):
        out = real(tensors, marks)
        if not calls:
            calls.append(1)
            state["b"].add_(1.0)  # just after the copy's check
        return out

    monkeypatch.setattr(unchanged, "torn_since", then_write)
    with SyncCheckpointEngine(tmp_path) as engine:
        with pytest.raises(SaveFailed) as info:
            engine.save(1, state, overlap=True).committed_sync(60)
    torn = info.value.__cause__
    assert isinstance(torn, StateModifiedWhileStaging)
    assert torn.keys == ["b"] and torn.unseen == [], torn
    assert "modified in place" in str(torn) and "no version counter" not in str(torn)


def test_under_a_staging_budget_nothing_is_packed(tmp_path, monkeypatch, caplog):
    """The packing's two scratch buffers sat outside ``Staging(max_host_bytes=)``: 6 MiB of
    small tensors under an 8 MiB budget took 18 MiB. Under a budget every small tensor is
    compared one by one (slower, no scratch), and the log says so; a write is still found."""
    from asyncckpt import Staging, SyncCheckpointEngine
    from asyncckpt.testing import parts

    monkeypatch.setattr(bytecheck, "_said_unpacked", False)
    state = {f"p{i}": torch.randn(16384) for i in range(96)}  # 96 x 64 KiB, all small
    with SyncCheckpointEngine(tmp_path, staging=Staging(max_host_bytes=8 << 20)) as engine:
        with caplog.at_level("INFO", logger="asyncckpt"):
            engine.save(1, state, overlap=True).committed_sync(60)
        slots = parts(engine).saver.slots
        assert [s.byte_check for s in slots if s.byte_check is not None] == [
            s.byte_check for s in slots if s.byte_check is not None and not s.byte_check.order
        ]
        held = sum(s.byte_check.src_buf.nbytes for s in slots if s.byte_check is not None)
        assert held == 0
    assert "none under Staging(max_host_bytes=)" in caplog.text
    slot = StagingSlot(0, pack_check=False)
    slot.ensure(state, pin=False)
    slot.copy_in(state, any_cuda=False)
    state["p70"].data.add_(1.0)
    assert bytecheck.changed_since_copied(slot, state) == ["p70"]


# ------------------------------------------------------------------ saves staged in chunks
def _chunk_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "rows": torch.randn(700, 300, generator=g).to(torch.bfloat16),  # sliced over chunks
        "strided": torch.randn(200, 90, generator=g).t(),  # rows made contiguous to compare
        "conj": torch.randn(40, 3, dtype=torch.complex64, generator=g).conj(),
        "neg": torch._neg_view(torch.randn(50, generator=g)),
        "scalar": torch.tensor(-0.0),
        "empty": torch.empty(0, 5),
        "nan": torch.full((9,), float("nan")),
    }


def _staged_in_chunks(tensors: dict[str, torch.Tensor], budget: int = 256 << 10):
    """Stage ``tensors`` chunk by chunk as a chunked save does (the copy, then the staged
    bytes fingerprinted); returns the fingerprints and the staged bytes of each tensor."""
    from asyncckpt.staging import chunked

    plan = chunked.plan_for(tensors, budget)
    arena = torch.zeros(plan.arena_bytes, dtype=torch.uint8)
    prints = bytecheck.ChunkFingerprints()
    srcs = list(tensors.values())
    staged: dict[int, list[bytes]] = {}
    for k, chunk in enumerate(plan.chunks):
        base = plan.buffer_offset(k)
        buf = arena[base : base + plan.chunk_bytes]
        for p in chunk.pieces:
            spec = plan.tensors[p.index]
            chunked._copy_piece(buf, srcs[p.index], spec, p)
            got = arena[base + p.offset : base + p.offset + p.nbytes].numpy()
            prints.staged(p.index, p.start, p.stop, spec.row_bytes, got)
            staged.setdefault(p.index, []).append(got.tobytes())
        prints.take()
    assert len(plan.chunks) >= 3  # (the test means several chunks)
    return prints, staged


def test_chunked_staged_bytes_are_the_sources_and_nothing_changed_is_named():
    from asyncckpt.staging.arenas import Marks

    tensors = _chunk_state()
    marks = Marks.of(tensors)
    prints, staged = _staged_in_chunks(tensors)
    for i, t in enumerate(tensors.values()):  # what was staged: the bytes the copy resolved
        want = t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        assert b"".join(staged.get(i, [])) == want.numpy().tobytes()
    assert prints.changed(tensors, list(tensors.values()), marks) == []
    assert prints.seconds > 0


@pytest.mark.parametrize(
    "key, write",
    [
        ("rows", lambda t: t.data[0, 0].add_(1.0)),  # the first slice
        ("rows", lambda t: t.data[-1, -1].add_(1.0)),  # the last slice
        ("strided", lambda t: t.data[89, 199].fill_(1e9)),
        ("conj", lambda t: t.data.imag.neg_()),
        ("neg", lambda t: t.data[7:8].zero_()),
        ("scalar", lambda t: t.data.fill_(0.0)),  # -0.0 -> 0.0: equal as floats, not bytes
        ("nan", lambda t: t.data.fill_(-float("nan"))),
    ],
)
def test_chunked_a_write_after_its_chunk_is_named(key, write):
    from asyncckpt.staging.arenas import Marks

    tensors = _chunk_state()
    marks = Marks.of(tensors)
    prints, _ = _staged_in_chunks(tensors)
    write(tensors[key])
    assert prints.changed(tensors, list(tensors.values()), marks) == [key]


def test_chunked_a_storage_freed_before_the_compare_is_never_read():
    from asyncckpt.errors import StateModifiedWhileStaging
    from asyncckpt.staging.arenas import Marks

    tensors = _chunk_state()
    marks = Marks.of(tensors)
    prints, _ = _staged_in_chunks(tensors)
    tensors["rows"].untyped_storage().resize_(0)
    with pytest.raises(StateModifiedWhileStaging) as info:
        prints.changed(tensors, list(tensors.values()), marks)
    assert info.value.storage == ["rows"]


def test_chunked_blocks_are_whole_rows():
    assert bytecheck._blocks(0, 10 << 20, 3000) == [
        (a, min(a + 349 * 3000, 10 << 20)) for a in range(0, 10 << 20, 349 * 3000)
    ]
    assert bytecheck._blocks(100, 100 + 5 * (3 << 20), 3 << 20)[1] == (3 << 20, 6 << 20)
    assert bytecheck._blocks(0, 0, 8) == []
