"""DCP's storage writer with every byte checksummed (CRC-32C) and paced on its way to the
file, small tensors' records written from templates, unchanged files linked (differential);
``write_flat`` runs one DCP save of a flat state with it.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem, SerializationFormat
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from asyncckpt import faults
from asyncckpt._torch import stateful_entries_as_is, storage_info_class
from asyncckpt.formats.dcp.metadata import quiet_single_process
from asyncckpt.formats.dcp.planner import _PassThroughPlanner, cache_plans
from asyncckpt.formats.differential import Linker, Previous, group_items
from asyncckpt.formats.records import RecordWriter, default_writer, tensor_bytes, torch_computes_crc
from asyncckpt.io.directio import DirectFile, open_for_write
from asyncckpt.io.throttle import write_all
from asyncckpt.storage.localfs import fsync_fd
from asyncckpt.storage.manifest import checksum

StorageInfo = storage_info_class()

#: Largest piece a shard stream hands to the file (and to the throttle) at once.
PIECE_BYTES = 1 << 20


#: The buffer between torch.save's many small writes and the checksumming stream.
BUFFER_BYTES = 1 << 20


class _ChecksumStream(io.RawIOBase):
    """A write-only file wrapper that keeps a running checksum and paces the writer.

    Large writes (a tensor's storage) are cut into ``PIECE_BYTES`` pieces: the checksum of a piece
    reads it from cache right after the copy into the file, and ``pace`` (the throttle's rate
    limit and pause hint) gets a say between pieces instead of once per tensor.
    """

    def __init__(self, raw: Any, pace: Callable[[int], None] | None) -> None:
        self._raw = raw
        self._pace = pace
        self.crc = 0
        self.size = 0
        # The first I/O error: torch.save replaces an error raised inside it with its own
        # "unexpected pos" RuntimeError, so create_stream re-raises this one instead.
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        for start in range(0, n, PIECE_BYTES):
            piece = view[start : start + PIECE_BYTES]
            if self._pace is not None:
                self._pace(len(piece))
            try:
                write_all(self._raw, piece)
            except OSError as exc:
                self.error = self.error or exc
                raise
            self.crc = checksum(piece, self.crc)
            first = self.size == 0
            self.size += len(piece)
            if first:
                faults.point("mid_shard_write")
        return n

    def tell(self) -> int:
        return self.size  # bytes written through this stream: the file's position

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        # Closed when DCP is done with the file (through the buffer in front of it); the file
        # itself is closed by create_stream, after the last block is out.
        super().close()


class _ChecksummingFileSystem(FileSystem):
    def __init__(
        self,
        crcs: dict[str, tuple[int, int]],
        pace: Callable[[int], None] | None,
        direct_io: bool,
    ):
        super().__init__()
        self._crcs = crcs
        self._pace = pace
        self._direct_io = direct_io

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        raw = open_for_write(path, direct=self._direct_io)
        stream = _ChecksumStream(raw, self._pace)
        # torch.save writes a tensor in ~40 small pieces: a C buffer in front of the
        # checksumming stream turns 20,000 tensors' 800,000 Python-level writes into a few
        # per tensor (DCP flushes after each item) and large ones into one.
        buffered = io.BufferedWriter(stream, buffer_size=BUFFER_BYTES)
        try:
            yield buffered
            if not buffered.closed:  # DCP closes it when done (which flushes it)
                buffered.close()
            raw.flush()
            raw.close()  # a DirectFile writes its last partial block here
        except BaseException as exc:
            with contextlib.suppress(OSError):  # the file is thrown away with the save
                raw.abort() if isinstance(raw, DirectFile) else raw.close()
            if stream.error is not None and exc is not stream.error:
                raise stream.error from exc  # the disk's error, not torch's wrapper of it
            raise
        self._crcs[Path(path).name] = (stream.crc, stream.size)


def _split_by_size_and_type(bins: int, items: list[Any]) -> list[list[Any]]:
    """Items into ``bins`` files as DCP's ``FileSystemWriter`` splits them: byte items round
    robin, tensors largest first into the lightest file (torch's own helper is private)."""
    if bins == 1:
        return [items]
    buckets: list[list[Any]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    for item in sorted(tensor_items, key=_item_bytes, reverse=True):
        lightest = min(range(bins), key=sizes.__getitem__)
        buckets[lightest].append(item)
        sizes[lightest] += _item_bytes(item)
    return buckets


def _item_bytes(item: Any) -> int:
    data = item.tensor_data
    return math.prod(data.size) * data.properties.dtype.itemsize


class ChecksumWriter(FileSystemWriter):
    """DCP's FileSystemWriter whose files are checksummed (and paced) while written, with
    ``O_DIRECT`` where ``direct_io`` asks for it and the filesystem allows it, and small
    tensors' ``torch.save`` records written from templates (``write_data``).

    ``crcs`` maps each file name written to ``(checksum, size)``; ``.metadata`` is renamed into
    place by DCP, so its entry is recorded under the temporary name and recomputed by the
    manifest builder.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        thread_count: int = 1,
        pace: Callable[[int], None] | None = None,
        direct_io: bool = False,
        sync_files: bool = False,
        records: RecordWriter | None = None,
        differential: Previous | None = None,
        threads_used: list[int] | None = None,
    ) -> None:
        super().__init__(
            path,
            single_file_per_rank=True,
            sync_files=sync_files,
            thread_count=thread_count,
            overwrite=True,
        )
        self.crcs: dict[str, tuple[int, int]] = {}
        self.fs = _ChecksummingFileSystem(self.crcs, pace, direct_io)
        self.records = records or default_writer
        self.differential = differential
        self.linker: Linker | None = None
        self.threads_used = threads_used  # gets the files written at once (WriteOptions)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's file layout and records, with small tensors' records written from templates.

        The same files (``<prefix><n>.distcp``, one per thread, items split as DCP splits
        them), the same order in each (byte items first) and byte-identical ``torch.save``
        records: only how the records are produced differs (``records.RecordWriter``). Where
        DCP's stream extensions are in use, DCP's own path writes.
        """
        if (
            self.transforms.extensions
            or self.serialization_format != SerializationFormat.TORCH_SAVE
        ):
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix
        if self.differential is not None:
            # Files grouped so that an unchanged group is a whole file (differential.py).
            self.linker = Linker(
                Path(self.path),
                prefix,
                self.differential.part(Path(self.path)),
                f"asyncckpt-dcp-1|torch {torch.__version__}|crc {torch_computes_crc()}",
                self.differential.known,
            )
            buckets = group_items(
                plan.items, _item_bytes, lambda i: i.type != WriteItemType.BYTE_IO
            )
        else:
            # No more files than items: DCP writes an empty file per idle thread.
            bins = max(1, min(self.thread_count, len(plan.items)))
            buckets = _split_by_size_and_type(bins, list(plan.items))
        jobs = [(f"{prefix}{n}{DEFAULT_SUFFIX}", items) for n, items in enumerate(buckets)]
        threads = min(self.thread_count, len(jobs))
        if self.threads_used is not None:
            self.threads_used.append(max(1, threads))
        if threads <= 1:
            # One writer: the next file's fingerprint is taken in a thread of its own while
            # this one is written (hashing ran at ~10 GB/s, the disk at 1-2: hidden that way).
            prepare = lambda job: self._prepare(job[1], planner)  # noqa: E731
            ready = _one_ahead(prepare, jobs) if self.linker else map(prepare, jobs)
            results = [self._write_file(name, r) for (name, _), r in zip(jobs, ready, strict=True)]
        else:
            with ThreadPoolExecutor(threads) as pool:
                results = list(
                    pool.map(
                        lambda job: self._write_file(job[0], self._prepare(job[1], planner)),
                        jobs,
                    )
                )
        if self.linker is not None:
            self.linker.finish()
        done: Future[list[WriteResult]] = Future()
        done.set_result([r for rs in results for r in rs])
        return done

    def _prepare(self, items: list[Any], planner: SavePlanner) -> _Prepared:
        """A file's items in the order written, their data and (differential) fingerprint."""
        byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
        tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
        ordered = byte_items + tensor_items
        data = [self._data(item, planner) for item in ordered]
        digest = None
        if self.linker is not None:
            digest = self.linker.timed_fingerprint(
                [
                    (_describe(item, d), _bytes_of(d), _where(d))
                    for item, d in zip(ordered, data, strict=True)
                ]
            )
        return _Prepared(ordered, data, digest)

    def _write_file(self, name: str, ready: _Prepared) -> list[WriteResult]:
        ordered, data, digest = ready.items, ready.data, ready.digest
        if self.linker is not None and digest is not None:
            linked = self.linker.try_link(name, digest, len(ordered))
            if linked is not None:
                places, crc = linked
                if crc is not None:
                    self.crcs[name] = crc
                return [
                    _result(item, name, offset, length)
                    for item, (offset, length) in zip(ordered, places, strict=True)
                ]
        out: list[WriteResult] = []
        places = []
        with_crc = torch_computes_crc()
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item, d in zip(ordered, data, strict=True):
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(d.getbuffer())
                else:
                    self.records.write(d, cast(BinaryIO, stream), with_crc)
                length = stream.tell() - offset
                places.append((offset, length))
                out.append(_result(item, name, offset, length))
            stream.flush()
            if self.sync_files:
                fsync_fd(stream.fileno())
        if self.linker is not None and digest is not None:
            self.linker.note(name, digest, self.crcs[name][1], places, linked=False)
        return out

    @staticmethod
    def _data(item: Any, planner: SavePlanner) -> Any:
        """A byte item's BytesIO, or the tensor as its record is written."""
        data: Any = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            return data
        tensor = data.detach().cpu()
        if tensor.untyped_storage().size() != tensor.nbytes:
            tensor = tensor.clone()  # as DCP: torch.save writes whole storages
        return tensor


@dataclass
class _Prepared:
    items: list[Any]
    data: list[Any]
    digest: str | None


def _one_ahead(fn: Callable[[Any], Any], jobs: list[Any]) -> Iterator[Any]:
    """``fn(job)`` for each job in order, the next one computed in a thread while the caller
    works on this one (at most two results alive: a file's data may be a clone)."""
    if len(jobs) < 2:
        yield from (fn(job) for job in jobs)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-fingerprint") as pool:
        nxt = pool.submit(fn, jobs[0])
        for i in range(len(jobs)):
            ready = nxt.result()
            if i + 1 < len(jobs):
                nxt = pool.submit(fn, jobs[i + 1])
            yield ready
            del ready


def _result(item: Any, name: str, offset: int, length: int) -> WriteResult:
    info = StorageInfo(relative_path=name, offset=offset, length=length)
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=info)


def _describe(item: Any, data: Any) -> str:
    """What an item is, beside its bytes, in a file's fingerprint."""
    index = item.index
    if isinstance(data, torch.Tensor):
        return f"{index.fqn}|{tuple(index.offset or ())}|t|{data.dtype}|{tuple(data.shape)}"
    return f"{index.fqn}|{tuple(index.offset or ())}|b"


def _where(data: Any) -> tuple[int, int] | None:
    """(address, nbytes) of a contiguous tensor's bytes: the key of a digest the trainer took
    of a staged view (``differential.known_digests``); None for anything else."""
    if isinstance(data, torch.Tensor) and data.is_contiguous() and data.nbytes > 0:
        return (data.data_ptr(), data.nbytes)
    return None


def _bytes_of(data: Any) -> Any:
    """The bytes a record holds (a tensor's, as written; a byte item's buffer)."""
    if isinstance(data, torch.Tensor):
        return tensor_bytes(data if data.is_contiguous() else data.contiguous())
    return data.getbuffer()


def write_flat(
    flat: Mapping[str, Any],
    directory: Path,
    *,
    thread_count: int = 1,
    pace: Callable[[int], None] | None = None,
    direct_io: bool = False,
    process_group: Any = None,
    planner: Any = None,
    plan_cache: str | None = None,
    object_paths: Mapping[str, tuple] | None = None,
    differential: Previous | None = None,
    writer: ChecksumWriter | None = None,
    threads_used: list[int] | None = None,
) -> dict[str, tuple[int, int]]:
    """Write a flat state dict as DCP shards into ``directory``; returns crcs per file.

    With a ``process_group``, every rank of it calls this for the same directory: DCP plans
    across them, each writes its own shards, and rank 0 alone writes ``.metadata``.
    ``plan_cache`` names what is written (a persistent worker writes the same layout again
    and again): a save reuses DCP's plans and metadata from the last save under that name
    while the layout holds (``DefaultSavePlanner``'s plan caching; across ranks, while no
    rank's process changed). ``object_paths`` (``dcp_object_paths``): each key's path in the
    nested state, recorded in ``.metadata`` as DCP's default planner records it.
    ``differential`` (``differential.Previous``): files whose bytes would be the previous
    checkpoint's are hard links to them (a sidecar records the fingerprints).
    ``writer``: the storage writer to use instead (its own options; chunked_write.py).
    ``threads_used``: gets how many files the writer wrote at once (``WriteOptions``).
    """
    writer = writer or ChecksumWriter(
        directory,
        thread_count=thread_count,
        pace=pace,
        direct_io=direct_io,
        differential=differential,
        threads_used=threads_used,
    )
    no_dist = process_group is None
    planner = planner or _PassThroughPlanner()
    if isinstance(planner, _PassThroughPlanner):
        planner.object_paths = object_paths
    if plan_cache is not None:
        cache_plans(planner, flat, plan_cache, object_paths, process_group)
    with quiet_single_process(), stateful_entries_as_is():
        dcp.save(
            dict(flat),
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
        )
    return writer.crcs
