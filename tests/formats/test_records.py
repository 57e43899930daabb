"""torch.save records written from templates (formats/records.py): byte for byte torch.save's."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from asyncckpt.formats import records
from asyncckpt.formats.dcp import Serialized, _PassThroughPlanner, write_flat
from asyncckpt.formats.records import MAX_TEMPLATE_BYTES, RecordWriter, make_template


def torch_save_bytes(t: object) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = torch.empty(shape, dtype=dtype).nbytes
    return torch.randint(0, 256, (n,), dtype=torch.uint8).view(dtype).view(shape)


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]
SHAPES = [(), (1,), (1024,), (3, 5), (257, 3), (2, 3, 4, 5)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_records_equal_torch_save_for_every_dtype_and_shape(dtype: torch.dtype) -> None:
    writer = RecordWriter()
    for shape in SHAPES:
        for _ in range(3):  # the same template with other data
            t = random_tensor(dtype, shape)
            if dtype == torch.bool:
                t = t.view(torch.uint8).remainder(2).view(torch.bool)
            out = io.BytesIO()
            writer.write(t, out)
            assert out.getvalue() == torch_save_bytes(t), (dtype, shape)
            back = torch.load(io.BytesIO(out.getvalue()), weights_only=True)
            assert back.dtype == dtype and back.shape == t.shape
            assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert writer.templated == 3 * len(SHAPES)  # none of them fell back to torch.save


def test_tensors_a_template_does_not_fit_keep_torch_save() -> None:
    writer = RecordWriter()
    big = torch.randn(MAX_TEMPLATE_BYTES // 4 + 1)
    base = torch.randn(64)
    cases = [
        big,  # too large to be worth a template
        base[8:40],  # a view: torch.save writes its whole storage
        base.view(8, 8).t(),  # not contiguous
        torch.randn(16, requires_grad=True),
        torch.empty(0),
    ]
    for t in cases:
        out = io.BytesIO()
        writer.write(t, out)
        assert out.getvalue() == torch_save_bytes(t)
    assert writer.templated == 0


def test_records_equal_torch_save_with_its_crc_switched_off(torch_crc32) -> None:
    # The worker switches torch's CRC computation off (the manifest checksums every byte):
    # the archive then holds zeros where CRCs go, and the templates must write the same.
    writer = RecordWriter()
    t = torch.randn(1024)
    for compute in (False, True, False):  # one writer, the setting changed between writes
        torch_crc32(compute)
        out = io.BytesIO()
        writer.write(t, out)
        assert out.getvalue() == torch_save_bytes(t), compute
        assert torch.equal(torch.load(io.BytesIO(out.getvalue()), weights_only=True), t)
    assert writer.templated == 3


def test_an_unrecognised_archive_gets_no_template(monkeypatch) -> None:
    monkeypatch.setattr(records, "_torch_save_bytes", lambda t: b"not a zip archive")
    assert make_template(torch.float32, (4,)) is None


def test_write_flat_files_equal_dcps_own(tmp_path) -> None:
    """The worker's DCP writer produces the very files DCP's FileSystemWriter does."""
    base = torch.randn(64)
    flat = {
        "model.w": torch.randn(32, 16),
        "model.b": torch.randn(16).to(torch.bfloat16),
        "model.mask": torch.rand(10) > 0.5,
        "model.big": torch.randn(MAX_TEMPLATE_BYTES // 4 + 3),  # torch.save path
        "model.view": base[4:20],  # cloned, as DCP does
        "optim.step": torch.tensor(7),
        "extra": Serialized(pickle.dumps({"epoch": 3})),
    }
    ours = write_flat(flat, tmp_path / "ours")
    theirs = tmp_path / "theirs"
    dcp.save(
        dict(flat),
        storage_writer=FileSystemWriter(theirs, single_file_per_rank=True, thread_count=1),
        planner=_PassThroughPlanner(),  # the same pre-serialised bytes item in both
        no_dist=True,
    )
    shard = "__0_0.distcp"
    assert shard in ours
    assert (tmp_path / "ours" / shard).read_bytes() == (theirs / shard).read_bytes()
    ours_md = dcp.FileSystemReader(tmp_path / "ours").read_metadata()
    theirs_md = dcp.FileSystemReader(theirs).read_metadata()
    assert ours_md.storage_data == theirs_md.storage_data
    assert ours_md.state_dict_metadata == theirs_md.state_dict_metadata

    target = {k: torch.zeros_like(v) for k, v in flat.items() if isinstance(v, torch.Tensor)}
    dcp.load(target, checkpoint_id=tmp_path / "ours", no_dist=True)
    for k, v in target.items():
        assert torch.equal(v, flat[k]), k


def test_write_flat_with_several_threads_loads_back(tmp_path) -> None:
    flat = {f"t{i}": torch.randn(100 + i) for i in range(40)}
    crcs = write_flat(flat, tmp_path / "ck", thread_count=3)
    assert len([n for n in crcs if n.endswith(".distcp")]) == 3
    target = {k: torch.zeros_like(v) for k, v in flat.items()}
    dcp.load(target, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert all(torch.equal(target[k], flat[k]) for k in flat)


def test_local_plan_reused_while_the_layout_holds(tmp_path, monkeypatch) -> None:
    from torch.distributed.checkpoint import default_planner

    calls = []
    original = default_planner.create_default_local_save_plan

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(default_planner, "create_default_local_save_plan", counting)
    key = f"test:{tmp_path.name}"

    def save_and_load(flat: dict, name: str) -> dict:
        write_flat(flat, tmp_path / name, plan_cache=key)
        target = {k: torch.zeros_like(v) for k, v in flat.items() if isinstance(v, torch.Tensor)}
        dcp.load(target, checkpoint_id=tmp_path / name, no_dist=True)
        for k, v in target.items():
            assert torch.equal(v, flat[k]), (name, k)
        return dcp.FileSystemReader(tmp_path / name).read_metadata().state_dict_metadata

    def state(shape_b: tuple[int, ...] = (8,), extra: bool = False) -> dict:
        flat = {"a": torch.randn(4, 4), "b": torch.randn(shape_b), "o": Serialized(b"x")}
        if extra:
            flat["c"] = torch.arange(3)
        return flat

    first = save_and_load(state(), "s1")
    assert len(calls) == 1
    assert save_and_load(state(), "s2") == first  # new values, same layout: plan reused
    assert len(calls) == 1
    changed = save_and_load(state(shape_b=(2, 5)), "s3")  # a shape changed: planned afresh
    assert len(calls) == 2 and changed["b"].size == torch.Size([2, 5])
    save_and_load(state(shape_b=(2, 5), extra=True), "s4")  # a key added
    assert len(calls) == 3
    save_and_load(state(shape_b=(2, 5), extra=True), "s5")
    assert len(calls) == 3
    # Not a flat state of plain tensors (a nested dict): nothing is reused, every time.
    nested = {"m": {"w": torch.randn(3)}}
    for name in ("n1", "n2"):
        write_flat(nested, tmp_path / name, plan_cache=key)
    assert len(calls) == 5


# ---------------------------------------------------------------------------------- reading


def record_file(tmp_path, tensors: list[torch.Tensor], crc: bool = True, set_crc32=None):
    """A file of torch.save records one after another (as a DCP shard), with their spans;
    ``set_crc32``: the ``torch_crc32`` fixture, to write them with ``crc``."""
    if set_crc32 is not None:
        set_crc32(crc)
    path = tmp_path / "records.bin"
    spans = []
    with open(path, "wb") as f:
        f.write(b"\0" * 13)  # records start anywhere in a shard
        for t in tensors:
            start = f.tell()
            torch.save(t, f)
            spans.append((start, f.tell() - start))
    if set_crc32 is not None:
        set_crc32(True)  # read with the default
    return path, spans


@pytest.mark.parametrize("crc", [True, False], ids=["crc", "no-crc"])
def test_read_record_gives_what_torch_load_gives(tmp_path, torch_crc32, crc) -> None:
    tensors = [random_tensor(dtype, shape) for dtype in DTYPES[:-1] for shape in SHAPES]
    tensors = [
        t.view(torch.uint8).remainder(2).view(torch.bool) if t.dtype == torch.bool else t
        for t in tensors
    ]
    big = torch.randn(MAX_TEMPLATE_BYTES // 4 + 5, 1)  # no template: located by torch
    tensors.append(big)
    path, spans = record_file(tmp_path, tensors, crc, torch_crc32)
    records.read_counts.clear()
    fd = os.open(path, os.O_RDONLY)
    try:
        for t, (offset, length) in zip(tensors, spans, strict=True):
            expected = torch.load(io.BytesIO(path.read_bytes()[offset : offset + length]))
            fresh = records.read_record(fd, offset, length, t.dtype, tuple(t.shape))
            out = torch.empty_like(t)
            into = records.read_record(fd, offset, length, t.dtype, tuple(t.shape), out)
            assert into is out  # straight into the target, no second tensor
            for got in (fresh, into):
                assert got.dtype == t.dtype and got.shape == t.shape
                assert torch.equal(
                    got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
                )
    finally:
        os.close(fd)
    assert records.read_counts == {"template": 2 * (len(tensors) - 1), "located": 2}


def test_records_that_are_not_one_whole_tensor_are_read_by_torch_load(tmp_path) -> None:
    base = torch.arange(64, dtype=torch.float32)
    view = base[8:40]  # torch.save writes the whole storage
    path, spans = record_file(tmp_path, [view, torch.randn(1024)])
    records.read_counts.clear()
    fd = os.open(path, os.O_RDONLY)
    with records.count_fallbacks() as fallbacks:
        try:
            got = records.read_record(fd, *spans[0], torch.float32, (32,))
            assert torch.equal(got, view)
            # A record whose pickle says float32, asked for as int32 (another tensor's
            # metadata): neither the int32 template nor torch's parsing accepts it, so
            # torch.load reads it for what it is and the caller's copy_ converts, as DCP does.
            other = records.read_record(fd, *spans[1], torch.int32, (1024,))
            assert other.dtype == torch.float32
        finally:
            os.close(fd)
    assert records.read_counts == {"torch.load": 2}
    assert fallbacks == {"not one whole tensor": 2}  # the slow reads are counted, not silent


def test_dcp_checkpoints_read_back_equal_through_the_fast_reader(tmp_path) -> None:
    """A checkpoint written by DCP itself (CRCs on, DCP's own writer) and one by ours read
    back through read_flat equal to plain dcp.load, partial targets included."""
    from asyncckpt.formats.dcp import read_flat

    flat = {
        "a": torch.randn(64, 3),
        "b": torch.randn(MAX_TEMPLATE_BYTES // 4 + 7),
        "c": torch.tensor([True, False, True]),
        "d": torch.randn(5).to(torch.bfloat16),
        "o": Serialized(torch_save_bytes({"x": 1})),  # as the trainer serialises objects
    }
    dcp.save(
        dict(flat),
        storage_writer=FileSystemWriter(tmp_path / "theirs", single_file_per_rank=True),
        planner=_PassThroughPlanner(),
        no_dist=True,
    )
    write_flat(flat, tmp_path / "ours")
    for name in ("theirs", "ours"):
        records.read_counts.clear()
        target = {"a": torch.zeros(64, 3), "b": torch.zeros(MAX_TEMPLATE_BYTES // 4 + 7)}
        got = read_flat(tmp_path / name, target)
        assert got["a"] is target["a"] and got["b"] is target["b"]  # read in place
        for k in ("a", "b", "c", "d"):
            assert torch.equal(got[k], flat[k]), (name, k)
        assert got["o"] == {"x": 1}
        assert records.read_counts["torch.load"] == 0, records.read_counts


def test_a_template_refused_while_the_setting_changed_is_made_again_later(torch_crc32) -> None:
    """A template asked for with CRCs while torch writes none comes out without them and is
    refused; that refusal must not be remembered, or the layout never gets one again."""
    writer = RecordWriter()
    torch_crc32(False)
    assert writer.template_for_layout(torch.float32, (8,), True) is None
    torch_crc32(True)
    template = writer.template_for_layout(torch.float32, (8,), True)
    assert template is not None and template.with_crc


def test_a_load_reports_records_that_fell_back_to_torch_load(tmp_path, monkeypatch, caplog):
    """A large record the fast reader cannot place is read by torch.load: correct, slower, and
    visible: counted in the load report and in ``records.fallbacks``, logged once per reason.
    On the fast path the count stays 0."""
    from asyncckpt import SyncCheckpointEngine

    state = {"big": torch.randn(MAX_TEMPLATE_BYTES // 4 + 9), "small": torch.randn(4)}
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state).committed_sync(120)

    def target() -> dict:
        return {k: torch.zeros_like(v) for k, v in state.items()}

    before = records.fallbacks.copy()
    engine = SyncCheckpointEngine(tmp_path)
    got = target()
    assert engine.load_latest(got) == 1
    assert engine.last_load_report.records_fallbacks == 0
    assert records.fallbacks == before
    assert all(torch.equal(got[k], state[k]) for k in state)

    # What a torch whose archives the reader cannot place does (as 2.9 did before _locate
    # parsed the zip entries itself): every large record falls back.
    reason = f"forced in {tmp_path.name}"  # a reason of its own: logged once per process
    monkeypatch.setattr(records, "_locate", lambda *args: (None, reason))
    caplog.set_level("WARNING", logger="asyncckpt")
    for _ in range(2):
        got = target()
        assert engine.load_latest(got) == 1
        assert all(torch.equal(got[k], state[k]) for k in state)
        assert engine.last_load_report.records_fallbacks == 1  # "big"; "small" has a template
    assert records.fallbacks[reason] == 2
    logged = [r for r in caplog.records if reason in r.getMessage()]
    assert len(logged) == 1, logged


def test_a_layout_without_template_is_counted_and_logged_once(monkeypatch, caplog) -> None:
    """Small records written by torch.save because no template was proven (another torch's
    archive) are counted (the worker reports them in SaveStats.records_fallbacks)."""
    monkeypatch.setattr(records, "_torch_save_bytes", lambda t: b"not a zip archive")
    monkeypatch.setattr(records, "_logged", set())  # this process may have logged it already
    caplog.set_level("WARNING", logger="asyncckpt")
    writer = RecordWriter()
    for shape in ((3,), (3,), (5,)):
        t = torch.randn(shape)
        out = io.BytesIO()
        writer.write(t, out)
        assert out.getvalue() == torch_save_bytes(t)
    big = torch.randn(MAX_TEMPLATE_BYTES // 4 + 1)  # no template by design: not a fallback
    writer.write(big, io.BytesIO())
    assert (writer.templated, writer.fallbacks) == (0, 3)
    assert len([r for r in caplog.records if "no template proven" in r.getMessage()]) == 1


def test_saves_on_the_fast_path_report_no_fallback(tmp_path) -> None:
    from asyncckpt import SyncCheckpointEngine

    state = {"a": torch.randn(16, 4), "b": torch.arange(7), "big": torch.randn(300_000)}
    with SyncCheckpointEngine(tmp_path) as engine:
        handle = engine.save(1, state)
        handle.committed_sync(120)
    assert handle.stats.records_fallbacks == 0
    assert handle.stats.as_dict()["records_fallbacks"] == 0
