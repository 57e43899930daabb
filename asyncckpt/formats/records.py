"""DCP's per-tensor ``torch.save`` records, written from templates and read without ``torch.load``.

DCP stores every tensor as its own ``torch.save`` record (a small zip archive) inside a shard
file, and plain ``dcp.load`` reads each one back with ``torch.load``. For a state of 20,000
small tensors that is 20,000 calls into the pickler and the C++ zip writer (~190 us each here),
most of a save's time. For a given dtype and shape those bytes never change except in four
places: the tensor's data, the data record's CRC-32 (after the data and in the central
directory), and the archive's ``.data/serialization_id``, which is a hash of the record names
(constant) followed by a hash of every record's CRC-32 (so it depends on the data's), together
with that record's own CRC-32.

Writing. A :class:`RecordTemplate` is made once per (dtype, shape) by running ``torch.save`` on
a tensor of that layout and parsing the archive; it is then *proven* against ``torch.save`` of
a random tensor of the same layout, byte for byte, before it is used. Any layout or torch
version whose archive does not match (another archive structure, a serialization setting)
gets no template and keeps ``torch.save``. So what lands on disk is exactly what
``torch.save`` would have written, and any reader of ``torch.save`` files reads it.

Reading (``read_record``). A record equal to its layout's template in every byte but the data,
the CRCs and the id is that layout's tensor, and its bytes are where the template's are; a
larger record is located by its zip entries, and ``torch.load`` onto the meta device (no data
read) says which tensor it holds. The bytes are then read straight into the caller's tensor.
Anything else is read by ``torch.load``, as DCP reads it. Integrity is not this module's job:
loads verify every file against the manifest before reading.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import struct
import sys
import threading
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, BinaryIO, cast

import torch

from asyncckpt.core.cachekeys import record_template_key
from asyncckpt.staging.arenas import writable_bytes

log = logging.getLogger("asyncckpt")

#: Tensors up to this size are written from a template; larger ones keep ``torch.save``, whose
#: fixed cost is nothing next to their data (and their template would cost a save of that size).
MAX_TEMPLATE_BYTES = 1 << 20

#: Templates one writer keeps (each is a few KiB); a state with more distinct layouts than
#: this still works, it just makes some templates again.
MAX_TEMPLATES = 4096

_DATA_RECORD = "data/0"
_ID_RECORD = ".data/serialization_id"
_ID_DIGITS = 20  # each half of the id: a 64-bit number, zero-padded (std::setw(20))
_MASK64 = (1 << 64) - 1
_LOCAL_HEADER_CRC = 14  # offset of the CRC-32 in a zip local file header
_CENTRAL_HEADER_CRC = 16  # ... and in a central directory entry
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``: how torch folds record CRCs into the id."""
    return (
        seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)
    ) & _MASK64


def _torch_save_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy, writable (a load reads into them).

    Through the data pointer, not ``Tensor.numpy()``: torch marks a storage exported to NumPy
    non-resizable for good, and a load into the caller's tensors must leave them resizable."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        raise ValueError(
            f"tensor_bytes takes a contiguous CPU tensor (not a conjugate or negative view), "
            f"not one on {t.device} with strides {t.stride()}: copy it with .contiguous() first"
        )
    return memoryview(writable_bytes(t))


@dataclass(frozen=True)
class RecordTemplate:
    """The bytes ``torch.save`` writes for one tensor layout, split around the data."""

    head: bytes  # everything before the data
    tail: bytes  # everything after it
    data_size: int
    head_crcs: tuple[int, ...]  # where the data record's CRC-32 goes in head
    tail_crcs: tuple[int, ...]  # ... and in tail (descriptor, central directory)
    id_at: int  # the serialization id's text (offset in tail)
    id_crcs: tuple[int, ...]  # where the id record's CRC-32 goes (offsets in tail)
    id_names: bytes  # the id's first half (hash of the record names)
    seed_before: int  # records' CRCs folded up to the data record
    crcs_after: tuple[int, ...]  # CRCs of the records between the data and the id
    #: False where torch was told not to compute CRCs (``compute_crc32``, as the worker
    #: does): every CRC is 0 and the bytes around the data never change.
    with_crc: bool = True
    #: Where any record's CRC-32 is, in the whole record: reading ignores them all, so one
    #: template recognises records written with CRCs and without.
    crc_spots: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.head) + self.data_size + len(self.tail)

    def render(self, data: memoryview) -> tuple[bytes, memoryview, bytes]:
        """The record for ``data`` (this layout's bytes), as three pieces to write in order."""
        if len(data) != self.data_size:
            raise ValueError(f"{len(data)} bytes for a template of {self.data_size}")
        if not self.with_crc:
            return self.head, data, self.tail
        crc = zlib.crc32(data)
        packed = struct.pack("<I", crc)
        seed = _hash_combine(self.seed_before, crc)
        for c in self.crcs_after:
            seed = _hash_combine(seed, c)
        ident = self.id_names + str(seed).zfill(_ID_DIGITS).encode()
        id_crc = struct.pack("<I", zlib.crc32(ident))
        head: bytes | bytearray = self.head
        if self.head_crcs:
            patched = bytearray(head)
            for at in self.head_crcs:
                patched[at : at + 4] = packed
            head = patched
        tail = bytearray(self.tail)
        for at in self.tail_crcs:
            tail[at : at + 4] = packed
        tail[self.id_at : self.id_at + len(ident)] = ident
        for at in self.id_crcs:
            tail[at : at + 4] = id_crc
        return bytes(head), data, bytes(tail)

    @cached_property
    def _fixed(self) -> tuple[tuple[int, int], ...]:
        """The spans of a whole record (head, data, tail) that are the same for every tensor
        of this layout: all but the data, its CRCs and the serialization id with its CRCs."""
        base = len(self.head) + self.data_size
        varying = sorted(
            [(at, at + 4) for at in self.head_crcs]
            + [(len(self.head), base)]
            + [(base + at, base + at + 4) for at in (*self.tail_crcs, *self.id_crcs)]
            + [(base + self.id_at, base + self.id_at + 2 * _ID_DIGITS)]
            + [(at, at + 4) for at in self.crc_spots]
        )
        spans, at = [], 0
        for start, end in varying:
            if start > at:
                spans.append((at, start))
            at = max(at, end)
        spans.append((at, self.size))
        return tuple(spans)

    @cached_property
    def _whole(self) -> bytes:
        return self.head + bytes(self.data_size) + self.tail

    def data_span(self, record: bytes) -> tuple[int, int] | None:
        """Where the tensor's bytes are in ``record``, if it is this layout's record (every
        fixed byte equal, with or without CRCs); None if it is not."""
        if len(record) != self.size:
            return None
        whole = self._whole
        for start, end in self._fixed:
            if record[start:end] != whole[start:end]:
                return None
        return len(self.head), len(self.head) + self.data_size


def _central_entries(raw: bytes, start: int, count: int) -> dict[str, int]:
    """Offset of each central directory entry, by file name."""
    out: dict[str, int] = {}
    at = start
    for _ in range(count):
        if raw[at : at + 4] != _CENTRAL_SIGNATURE:
            raise ValueError("unexpected central directory")
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, at + 28)
        name = raw[at + 46 : at + 46 + name_len].decode()
        out[name] = at
        at += 46 + name_len + extra_len + comment_len
    return out


def _crc_places(raw: bytes, info: zipfile.ZipInfo, central_at: int) -> tuple[int, list[int]]:
    """Where one record's payload starts, and every offset its CRC-32 is stored at.

    The central directory always holds it; the local header holds it unless the record has a
    data descriptor (general-purpose flag bit 3: CRC 0 in the header, the CRC after the payload,
    with or without the descriptor's signature), which is how torch's writer stores it.
    """
    flags, name_len, extra_len = (
        struct.unpack_from("<H", raw, info.header_offset + 6)[0],
        *struct.unpack_from("<HH", raw, info.header_offset + 26),
    )
    payload = info.header_offset + 30 + name_len + extra_len
    places = [central_at + _CENTRAL_HEADER_CRC]
    if flags & 0x08:
        after = payload + info.file_size
        places.append(after + 4 if raw[after : after + 4] == _DESCRIPTOR_SIGNATURE else after)
    else:
        places.append(info.header_offset + _LOCAL_HEADER_CRC)
    for at in places:
        if struct.unpack_from("<I", raw, at)[0] != info.CRC:
            raise ValueError(f"no CRC where expected for {info.filename}")
    return payload, places


def _parse(raw: bytes, data_size: int) -> RecordTemplate:
    """A template from one ``torch.save`` archive; ValueError where it is not the shape we know."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        infos = z.infolist()
        start_dir = z.start_dir
    prefix = infos[0].filename.split("/", 1)[0] + "/"
    names = [i.filename[len(prefix) :] for i in infos]
    if _DATA_RECORD not in names or names[-1] != _ID_RECORD:
        raise ValueError(f"unexpected records {names}")
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise ValueError("compressed records")
    central = _central_entries(raw, start_dir, len(infos))
    places = [_crc_places(raw, info, central[info.filename]) for info in infos]
    k = names.index(_DATA_RECORD)
    data_info, id_info = infos[k], infos[-1]
    if data_info.file_size != data_size:
        raise ValueError("data record size")
    (data_at, data_crcs), (id_at, id_crcs) = places[k], places[-1]
    tail_at = data_at + data_size
    with_crc = data_info.CRC == zlib.crc32(raw[data_at:tail_at])
    if not with_crc and data_info.CRC != 0:
        raise ValueError("the data record's CRC is neither its CRC-32 nor 0")
    if id_at < tail_at:
        raise ValueError("the id record precedes the data")
    ident = raw[id_at : id_at + id_info.file_size]
    if len(ident) != 2 * _ID_DIGITS or not ident.isdigit():
        raise ValueError("unexpected serialization id")
    seed = 0
    for info in infos[:k]:
        seed = _hash_combine(seed, info.CRC)
    return RecordTemplate(
        head=raw[:data_at],
        tail=raw[tail_at:],
        data_size=data_size,
        head_crcs=tuple(at for at in data_crcs if at < data_at),
        tail_crcs=tuple(at - tail_at for at in data_crcs if at >= tail_at),
        id_at=id_at - tail_at,
        id_crcs=tuple(at - tail_at for at in id_crcs),
        id_names=ident[:_ID_DIGITS],
        seed_before=seed,
        crcs_after=tuple(i.CRC for i in infos[k + 1 : -1]),
        with_crc=with_crc,
        crc_spots=tuple(at for _, spots in places for at in spots),
    )


def torch_computes_crc() -> bool:
    """Whether ``torch.save`` writes CRC-32s now (``torch.serialization.set_crc32_options``)."""
    return bool(torch.serialization.get_crc32_options())


def make_template(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordTemplate | None:
    """A template for this layout under torch's current serialization settings, proven equal
    to ``torch.save`` on random data; None where it is not."""
    probe = torch.empty(shape, dtype=dtype)
    size = probe.numel() * probe.element_size()
    if size == 0 or size > MAX_TEMPLATE_BYTES:
        return None
    try:
        template = _parse(_torch_save_bytes(torch.zeros(shape, dtype=dtype)), size)
        # The proof: random bytes (every dtype can hold any bit pattern in a byte view).
        sample = torch.randint(0, 256, (size,), dtype=torch.uint8).view(dtype).view(shape)
        rendered = b"".join(template.render(tensor_bytes(sample)))
        if rendered != _torch_save_bytes(sample):
            return None
    except (ValueError, RuntimeError, TypeError, zipfile.BadZipFile, struct.error):
        return None
    return template


class RecordWriter:
    """Writes ``torch.save`` records, from a template where the tensor allows it.

    Templates are kept per layout (``cachekeys.record_template_key``) for the life of the writer (a persistent worker
    writes the same layouts again and again: ``default_writer`` serves its saves); a layout
    without one is remembered too.
    """

    def __init__(self) -> None:
        self._templates: dict[tuple, RecordTemplate | None]  # by ``cachekeys.record_template_key``
        self._templates = {}
        self._lock = threading.Lock()
        self.templated = 0  # records written from a template (for tests and benchmarks)
        #: records of small plain tensors written by torch.save all the same (no template
        #: could be proven for their layout): slower, and counted in ``SaveStats``
        self.fallbacks = 0

    @staticmethod
    def _plain(t: torch.Tensor) -> bool:
        """A contiguous CPU tensor that is its whole storage: what a template can write."""
        return not (
            type(t) is not torch.Tensor
            or t.device.type != "cpu"
            or t.requires_grad
            or not t.is_contiguous()
            or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()
            or t.is_quantized
            or t.is_sparse
        )

    def template_for(self, t: torch.Tensor, with_crc: bool) -> RecordTemplate | None:
        """The template for ``t`` with torch's CRC setting ``with_crc``; None: use torch.save."""
        if not self._plain(t):
            return None
        return self.template_for_layout(t.dtype, tuple(t.shape), with_crc)

    def template_for_layout(
        self, dtype: torch.dtype, shape: tuple[int, ...], with_crc: bool
    ) -> RecordTemplate | None:
        key = record_template_key(dtype, shape, with_crc)
        try:
            return self._templates[key]
        except KeyError:
            pass
        template = make_template(dtype, shape)
        if template is not None and template.with_crc != with_crc:
            return None  # the setting changed under us: not remembered, made on the next call
        with self._lock:
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.clear()  # a state of countless distinct shapes: start over
            self._templates[key] = template
        return template

    def write(self, t: torch.Tensor, stream: BinaryIO, with_crc: bool | None = None) -> None:
        """Write ``t`` as ``torch.save(t, stream)`` would.

        ``with_crc``: ``torch_computes_crc()``, read once by a caller writing many records.
        """
        if with_crc is None:
            with_crc = torch_computes_crc()
        template = self.template_for(t, with_crc)
        if template is None:
            if self._plain(t) and 0 < t.nbytes <= MAX_TEMPLATE_BYTES:
                # A layout that should have had one: this torch's archive was not proven.
                with self._lock:
                    self.fallbacks += 1
                _log_once("writing", "no template proven for this layout", "RecordWriter.fallbacks")
            torch.save(t, stream)
            return
        for piece in template.render(tensor_bytes(t)):
            stream.write(piece)
        self.templated += 1


# ---------------------------------------------------------------------------------- reading

#: How records were read (tests and benchmarks read it): "template" (compared with this
#: layout's template), "located" (found by torch.load on the meta device) or "torch.load".
read_counts: Counter[str] = Counter()

#: Records of tensors with data that the fast reader could not place and left to
#: ``torch.load`` (a second copy of every byte), by reason, for the life of the process.
fallbacks: Counter[str] = Counter()
_tally = threading.local()  # the counter of the load running in this thread, if any
_logged: set[tuple[str, str]] = set()
_logged_lock = threading.Lock()


def _fell_back(why: str) -> None:
    fallbacks[why] += 1
    counter = getattr(_tally, "counter", None)
    if counter is not None:
        counter[why] += 1
    _log_once("reading", why, "records.fallbacks and LoadReport.records_fallbacks")


def _log_once(doing: str, why: str, counted: str) -> None:
    with _logged_lock:
        first = (doing, why) not in _logged
        _logged.add((doing, why))
    if first:  # once per reason and process: 20,000 such records log one line
        log.warning(
            "%s DCP records the slow way (%s): correct, but slower than the direct path; "
            "%s count them (torch %s)",
            doing,
            why,
            counted,
            torch.__version__,
        )


@contextlib.contextmanager
def count_fallbacks() -> Iterator[Counter[str]]:
    """Count, by reason, the records read in this thread that fell back to ``torch.load``."""
    before = getattr(_tally, "counter", None)
    _tally.counter = counter = Counter[str]()
    try:
        yield counter
    finally:
        _tally.counter = before
        if before is not None:
            before.update(counter)


def _slice(fd: int, start: int, length: int) -> BinaryIO:
    """``_FileSlice`` typed as the binary file ``torch.load`` takes (it is one)."""
    return cast(BinaryIO, _FileSlice(fd, start, length))


class _FileSlice(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``start`` of an open file."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._length - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [memoryview(b)[:n]], self._start + self._pos)
        self._pos += got
        return got


def pread_into(fd: int, into: memoryview, offset: int) -> None:
    """Fill ``into`` from ``offset`` of ``fd`` (a short read is an error: a truncated file)."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got <= 0:
            raise EOFError(f"file ends {len(into) - done} bytes short of a record")
        done += got


def _payload_at(fd: int, offset: int, info: zipfile.ZipInfo) -> int:
    """Where a stored zip entry's bytes start, from its local header (record at ``offset``)."""
    header = os.pread(fd, 30, offset + info.header_offset)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError(f"no local header for {info.filename}")
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    return info.header_offset + 30 + name_len + extra_len


def _locate(
    fd: int, offset: int, length: int, dtype: torch.dtype, shape: tuple
) -> tuple[int | None, str]:
    """Where the tensor's bytes start in a record of any size, and if not, why not.

    The archive's own zip entries say where its one data record's payload is and how long it
    is; ``torch.load`` onto the meta device under ``skip_data`` (no data read, on every torch:
    before 2.11 a plain meta load reads the data and records no offset) says what tensor that
    record holds. None unless it is one contiguous tensor of ``dtype`` and ``shape`` whose
    storage is exactly that record, in this machine's byte order.
    """
    try:
        with zipfile.ZipFile(_FileSlice(fd, offset, length)) as z:
            infos = z.infolist()
        prefix = infos[0].filename.split("/", 1)[0] + "/"
        by_name = {i.filename[len(prefix) :]: i for i in infos}
        data = [i for name, i in by_name.items() if name.startswith("data/")]
        if len(data) != 1 or any(i.compress_type != zipfile.ZIP_STORED for i in infos):
            return None, "not one stored tensor"
        at = _payload_at(fd, offset, data[0])
        byteorder = b"little"
        if "byteorder" in by_name:  # read raw: zipfile would check a CRC torch may not write
            info = by_name["byteorder"]
            byteorder = os.pread(fd, info.file_size, offset + _payload_at(fd, offset, info))
        with torch.serialization.skip_data():
            t = torch.load(_slice(fd, offset, length), map_location="meta", weights_only=True)
    except Exception:  # noqa: BLE001 - any record we cannot parse so goes to torch.load
        return None, "archive not parsed"
    if (
        type(t) is not torch.Tensor
        or t.dtype != dtype
        or tuple(t.shape) != tuple(shape)
        or not t.is_contiguous()
        or t.storage_offset() != 0
        or data[0].file_size != t.nbytes
    ):
        return None, "not one whole tensor"
    if bytes(byteorder).decode() != sys.byteorder:
        return None, "other byte order"
    if at + t.nbytes > length:
        return None, "archive not parsed"
    return at, ""


def read_record(
    fd: int,
    offset: int,
    length: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    out: torch.Tensor | None = None,
    with_crc: bool | None = None,
) -> torch.Tensor:
    """The tensor in the ``torch.save`` record at ``offset`` of ``fd``: what ``torch.load``
    of those bytes returns, without its unpickling or its second copy.

    A record of a small tensor is read whole and compared with its layout's template; a
    larger one is located by ``torch.load`` on the meta device. Either way its bytes go
    straight into ``out`` when given (a contiguous CPU tensor of ``dtype`` and ``shape``, not a
    conjugate or negative view), else into a new tensor. A record that is neither (another
    torch, a non-contiguous or shared storage) is read by ``torch.load`` as DCP reads it. ``with_crc``:
    ``torch_computes_crc()``, read once by a caller reading many records (a template
    recognises records written either way; this only picks which one is made).
    """
    if out is not None and not fits(out, dtype, shape):
        out = None
    where = place_record(fd, offset, length, dtype, shape, with_crc)
    count(where)
    if where.record is not None and where.span is not None:
        dst = out if out is not None else torch.empty(shape, dtype=dtype)
        tensor_bytes(dst)[:] = memoryview(where.record)[where.span[0] : where.span[1]]
        return dst
    if where.at is not None:
        dst = out if out is not None else torch.empty(shape, dtype=dtype)
        pread_into(fd, tensor_bytes(dst), offset + where.at)
        return dst
    return torch.load(_slice(fd, offset, length), map_location="cpu", weights_only=True)


def fits(out: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether a record's bytes can go straight into ``out``: a contiguous CPU tensor of
    ``dtype`` and ``shape``, not a conjugate or negative view (its memory is not its values)."""
    return (
        out.device.type == "cpu"
        and out.dtype == dtype
        and tuple(out.shape) == tuple(shape)
        and out.is_contiguous()
        and not (out.is_conj() or out.is_neg())
    )


@dataclass
class Placement:
    """Where a record's tensor bytes are: at ``span`` of ``record`` (the record, read whole
    to recognise its template), or ``at`` bytes from the record's start; neither: the record
    is one for ``torch.load``."""

    record: bytes | None = None
    span: tuple[int, int] | None = None
    at: int | None = None
    why: str | None = None  # why a record of data is left to torch.load


def place_record(
    fd: int,
    offset: int,
    length: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    with_crc: bool | None = None,
    *,
    read_small: bool = True,
) -> Placement:
    """Where the tensor's bytes are in the record at ``offset`` of ``fd`` (``read_record``'s
    first half; any thread); ``count`` it in the thread of the load. ``read_small=False``:
    a small record is located too, not read whole (its bytes come from elsewhere)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if 0 < nbytes <= MAX_TEMPLATE_BYTES and read_small:
        if with_crc is None:
            with_crc = torch_computes_crc()
        template = default_writer.template_for_layout(dtype, tuple(shape), with_crc)
        if template is not None and length == template.size:
            record = os.pread(fd, length, offset)
            span = template.data_span(record)
            if span is not None:
                return Placement(record=record, span=span)
    if nbytes > 0:
        at, why = _locate(fd, offset, length, dtype, tuple(shape))
        if at is not None:
            return Placement(at=at)
        return Placement(why=why)
    return Placement()


def count(where: Placement) -> None:
    """Count a placement in ``read_counts`` (a fallback also in ``fallbacks``, and in this
    thread's ``count_fallbacks``)."""
    if where.span is not None:
        read_counts["template"] += 1
    elif where.at is not None:
        read_counts["located"] += 1
    else:
        if where.why is not None:
            _fell_back(where.why)
        read_counts["torch.load"] += 1


#: The process's writer: a persistent worker's saves share its templates.
default_writer = RecordWriter()
