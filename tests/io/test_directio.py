"""O_DIRECT shard files: same bytes as a buffered write for every size and write pattern, the
padding truncated away, nothing half-written kept on abort, and a clean fallback where the
filesystem refuses O_DIRECT."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from asyncckpt.io import directio
from asyncckpt.io.directio import ALIGN, DirectFile, open_for_write
from asyncckpt.storage.manifest import checksum

needs_o_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def _direct_or_skip(path: Path, **kw) -> DirectFile:
    try:
        return DirectFile(path, **kw)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            pytest.skip(f"the test directory's filesystem refuses O_DIRECT: {exc}")
        raise


@needs_o_direct
@pytest.mark.parametrize(
    "pieces",
    [
        [],  # empty file
        [1],
        [ALIGN - 1],
        [ALIGN],
        [ALIGN + 1],
        [3 * ALIGN],  # exactly the (small) bounce buffer below
        [5, 4091, 1, 3 * ALIGN + 17, 2 * ALIGN],  # unaligned pieces that straddle buffers
        [10 * ALIGN + 123],  # one write larger than the bounce buffer
    ],
)
def test_direct_file_writes_exactly_the_bytes(tmp_path: Path, pieces: list[int]) -> None:
    rng = torch.Generator().manual_seed(sum(pieces) + len(pieces))
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng) for n in pieces]
    path = tmp_path / "shard.distcp"
    f = _direct_or_skip(path, buffer_bytes=3 * ALIGN)
    pos = 0
    for d in data:
        assert f.write(d.numpy()) == len(d)
        pos += len(d)
        assert f.tell() == pos
    f.close()
    f.close()  # idempotent
    want = b"".join(d.numpy().tobytes() for d in data)
    assert path.read_bytes() == want  # padding truncated away, nothing reordered
    with pytest.raises(ValueError, match="closed"):
        f.write(b"x")


@needs_o_direct
def test_direct_file_abort_skips_the_tail(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    f = _direct_or_skip(path, buffer_bytes=ALIGN)
    f.write(b"a" * (ALIGN + 10))  # one full block out, 10 bytes still buffered
    f.abort()
    assert path.read_bytes() == b"a" * ALIGN


def test_direct_file_rejects_a_misaligned_buffer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple"):
        DirectFile(tmp_path / "x", buffer_bytes=ALIGN + 1)


@needs_o_direct
def test_torch_save_through_direct_file_round_trips(tmp_path: Path) -> None:
    # torch.save writes small headers and one big storage record: unaligned sizes throughout.
    state = {"w": torch.randn(1000, 37), "b": torch.arange(11, dtype=torch.int16)}
    path = tmp_path / "t.pt"
    f = _direct_or_skip(path)
    torch.save(state, f)
    f.close()
    back = torch.load(path)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


@needs_o_direct
def test_open_for_write_uses_o_direct_where_allowed_else_buffered(
    tmp_path: Path, monkeypatch
) -> None:
    f = open_for_write(tmp_path / "a", direct=False)
    assert not isinstance(f, DirectFile)
    f.close()

    def refuse(*args, **kwargs):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(directio, "DirectFile", refuse)
    f = open_for_write(tmp_path / "b", direct=True)  # refused: falls back, still a file
    f.write(b"hello")
    f.close()
    assert (tmp_path / "b").read_bytes() == b"hello"


def test_tmpfs_gets_a_working_file_with_or_without_o_direct() -> None:
    # tmpfs refused O_DIRECT before Linux 6.6 and accepts it since: either way the bytes land,
    # through a DirectFile exactly when the kernel takes O_DIRECT there.
    shm = Path("/dev/shm")
    if not shm.is_dir() or not hasattr(os, "O_DIRECT"):
        pytest.skip("no /dev/shm tmpfs here")
    path = shm / f"asyncckpt-test-{os.getpid()}"
    try:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
            kernel_takes_it = True
        except OSError:
            kernel_takes_it = False
        f = open_for_write(path, direct=True)
        assert isinstance(f, DirectFile) == kernel_takes_it
        f.write(b"x" * 5000)
        f.close()
        assert path.read_bytes() == b"x" * 5000
    finally:
        path.unlink(missing_ok=True)


@needs_o_direct
def test_dcp_shards_written_with_o_direct_load_with_plain_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from asyncckpt.formats.dcp import write_flat

    probe = open_for_write(tmp_path / "probe", direct=True)
    probe.close()
    if not isinstance(probe, DirectFile):
        pytest.skip("filesystem refuses O_DIRECT")
    flat = {"a": torch.randn(333, 7), "b": torch.arange(5000, dtype=torch.int64)}
    crcs = write_flat(flat, tmp_path / "ckpt", direct_io=True)
    shard = next((tmp_path / "ckpt").glob("*.distcp"))
    assert crcs[shard.name] == (checksum(shard.read_bytes()), shard.stat().st_size)
    out = {"a": torch.zeros(333, 7), "b": torch.zeros(5000, dtype=torch.int64)}
    dcp.load(out, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert torch.equal(out["a"], flat["a"]) and torch.equal(out["b"], flat["b"])


@needs_o_direct
def test_a_refused_o_direct_write_falls_back_to_the_page_cache(tmp_path: Path, monkeypatch) -> None:
    import fcntl

    real_write = os.pwrite
    refused = []

    def picky_write(fd, data, offset):
        # Like a filesystem that takes O_DIRECT at open but refuses the write itself.
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data, offset)

    path = tmp_path / "shard"
    f = _direct_or_skip(path, buffer_bytes=ALIGN)
    monkeypatch.setattr(directio.os, "pwrite", picky_write)
    payload = bytes(range(256)) * 40 + b"tail"  # 2.5 blocks: full blocks, then a padded tail
    f.write(payload)
    f.close()
    assert refused == [ALIGN] and not f.direct
    assert path.read_bytes() == payload


@needs_o_direct
@pytest.mark.parametrize("depth", [1, 4])
def test_other_write_errors_are_not_swallowed(tmp_path: Path, monkeypatch, depth: int) -> None:
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    f = _direct_or_skip(tmp_path / "shard", buffer_bytes=ALIGN, depth=depth)
    monkeypatch.setattr(directio.os, "pwrite", full)
    with pytest.raises(OSError) as info:
        # Synchronous (depth 1): the first full block fails its write. Pipelined: a later
        # write finds the writer thread's error once every buffer is taken.
        for _ in range(depth + 1):
            f.write(b"x" * ALIGN)
    assert info.value.errno == errno.ENOSPC
    fd = f.fileno()
    f.abort()  # with the error's traceback still holding a slice of the bounce buffer
    assert f.closed
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor is closed, not leaked


@needs_o_direct
def test_an_error_of_a_write_in_flight_is_raised_by_close(tmp_path: Path, monkeypatch) -> None:
    # One block handed to the writer thread, then close: the file must not look written.
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    f = _direct_or_skip(tmp_path / "shard", buffer_bytes=ALIGN, depth=4)
    monkeypatch.setattr(directio.os, "pwrite", full)
    f.write(b"x" * (ALIGN + 5))
    with pytest.raises(OSError) as info:
        f.close()
    assert info.value.errno == errno.ENOSPC and f.closed


@needs_o_direct
def test_pipelined_writes_land_at_their_offsets(tmp_path: Path) -> None:
    # Many buffers through the writer thread, in pieces that straddle them: the same bytes as
    # one synchronous writer, in order.
    rng = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (37 * ALIGN + 999,), dtype=torch.uint8, generator=rng).numpy()
    for depth in (1, 2, 4):
        path = tmp_path / f"d{depth}"
        f = _direct_or_skip(path, buffer_bytes=2 * ALIGN, depth=depth)
        for at in range(0, len(data), 3001):
            f.write(data[at : at + 3001])
        f.close()
        assert path.read_bytes() == data.tobytes()


def test_direct_file_rejects_a_depth_below_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="depth"):
        DirectFile(tmp_path / "x", depth=0)


@pytest.mark.parametrize("direct", [False, True])
def test_shard_writes_are_paced_piece_by_piece(tmp_path: Path, direct: bool) -> None:
    # The worker's Pacer (rate cap + pause hint) gets a say before every piece of every file,
    # and the pieces it is told of add up to exactly what was written.
    from asyncckpt.formats.dcp import PIECE_BYTES, write_flat

    paced: list[int] = []
    flat = {"big": torch.randn(3 * PIECE_BYTES // 4 + 123), "small": torch.arange(7)}
    crcs = write_flat(flat, tmp_path / "ckpt", pace=paced.append, direct_io=direct)
    assert max(paced) <= PIECE_BYTES and len(paced) >= 4
    assert sum(paced) == sum(size for _, size in crcs.values())


@needs_o_direct
def test_bounce_buffers_are_reused_by_the_next_file(tmp_path: Path) -> None:
    # A fresh mmap is page-faulted in on first touch: a save of many files paid that per file.
    f = _direct_or_skip(tmp_path / "a", buffer_bytes=2 * ALIGN, depth=2)
    first = {id(b) for b in f._bufs}
    f.write(b"a" * (5 * ALIGN + 1))
    f.close()
    g = DirectFile(tmp_path / "b", buffer_bytes=2 * ALIGN, depth=2)
    assert {id(b) for b in g._bufs} == first
    g.write(b"b" * 100)
    g.close()
    assert (tmp_path / "a").read_bytes() == b"a" * (5 * ALIGN + 1)
    assert (tmp_path / "b").read_bytes() == b"b" * 100  # no bytes of the last file's
