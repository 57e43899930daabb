"""Plain torch.distributed.checkpoint: ``.metadata`` plus ``.distcp`` shards.

The worker writes a *flat* state dict whose keys are the same fully-qualified names DCP would
produce from the nested state, so ``dcp.load(nested_state, checkpoint_id=dir)`` works without
asyncckpt. Our writer is DCP's ``FileSystemWriter`` with one change: every byte goes through a
stream that computes its checksum (CRC-32C) on the way (no read-back for the manifest) and honours the
throttle's rate limit and the ``mid_shard_write`` fault point.
"""

from __future__ import annotations

import contextlib
import io
import math
import operator
import os
import threading
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    SerializationFormat,
)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from asyncckpt import faults
from asyncckpt._torch import (
    StorageInfo,
    dcp_plan_cache,
    dcp_plan_caches,
    inner_dcp_load,
    stateful_entries_as_is,
)
from asyncckpt.cluster.dist import (
    LocalShard,
    ShardInfo,
    dtensor_shard_info,
    is_dtensor,
    is_dtensor_type,
)
from asyncckpt.core import layout as L
from asyncckpt.core.cachekeys import (
    DcpPlanKeys,
    dcp_plan_signature,
    metadata_file_key,
    signature_digest,
)
from asyncckpt.core.entries import Entries, has_sharded_base
from asyncckpt.formats import hotread, wholefiles
from asyncckpt.formats.base import (
    Crcs,
    Format,
    LoadOptions,
    Paths,
    Prepared,
    SaveOptions,
    Verify,
    WriteOptions,
)
from asyncckpt.formats.differential import Linker, Previous, group_items
from asyncckpt.formats.records import (
    Placement,
    RecordWriter,
    count,
    default_writer,
    fits,
    place_record,
    tensor_bytes,
    torch_computes_crc,
)
from asyncckpt.io.directio import DirectFile, open_for_write
from asyncckpt.io.throttle import write_all
from asyncckpt.staging.arenas import PathItem, flatten_state, is_stateful, serialize_objects
from asyncckpt.storage.localfs import fsync_fd
from asyncckpt.storage.manifest import ChecksumMismatch, checksum, entry_problem


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process save/load that torch.distributed is not initialised;
    # for us that is the normal case, not news.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


#: Largest piece a shard stream hands to the file (and to the throttle) at once.
PIECE_BYTES = 1 << 20


class Serialized(bytes):
    """A leaf already serialised with ``torch.save`` by the trainer; written as is."""


#: DCP's plan-cache key per name written again and again (``cachekeys`` says what it covers).
_PLAN_KEYS = DcpPlanKeys()


class _PassThroughPlanner(DefaultSavePlanner):
    """DCP's default planner for the worker's flat states: pre-serialised leaves are written
    as they are, and with plan caching the *local* plan is reused too.

    DCP's plan caching skips the global planning when the local plan is unchanged, but builds
    the local plan every time to find out (~20 us a tensor, 0.4 s at 20,000). ``write_flat``
    turns caching on only under a key that covers the state's whole layout
    (``cachekeys.dcp_plan_signature``), so a plan cached under the key is this state's local
    plan, and it is taken instead, as DCP does when its comparison succeeds.
    """

    _reuse: SavePlan | None = None
    #: Each flat key's object path in the nested state (``object_paths``), written as
    #: ``.metadata``'s ``planner_data`` where the planner flattens (DCP's default planner maps
    #: a key to its path; flattening a flat state would map each key to itself, and DCP's
    #: tools, ``dcp_to_torch_save``, would give back flat keys).
    object_paths: Mapping[str, tuple] | None = None
    #: Node-local storage (``node_commit.py``): a tensor every rank holds alike is written by
    #: rank 0, whose files every node's root gets; DCP's default spreads them over the ranks,
    #: so another node's directory would lack some. Set once per worker process.
    replicated_on_rank0: bool = False

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        if _PassThroughPlanner.replicated_on_rank0:  # (DefaultSavePlanner's own option)
            self.dedup_save_to_lowest_rank = True
        key = self._cached_plans_key
        # What DCP's caching needs from the last save: every rank its own local and final
        # plans, the coordinator also every rank's plans and the metadata.
        names = ["_cached_save_plan", "_cached_final_save_plan"]
        if is_coordinator:
            names += ["_cached_all_plans", "_cached_metadata"]
        caches = [dcp_plan_cache(n) for n in names]
        cached = self._enable_plan_caching and all(key in cache for cache in caches)
        if not cached:
            self._reuse = None
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            if self.flatten_state_dict and self.object_paths:
                paths = self.object_paths
                self.mappings = {k: paths.get(k, p) for k, p in self.mappings.items()}
            return
        # A flat state flattens to itself: the traversal is skipped with the planning (the
        # plan's planner_data is the mapping: the cache key covers the object paths).
        self._reuse = dcp_plan_cache("_cached_save_plan")[key]
        self.mappings = self._reuse.planner_data
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        if self._reuse is None:
            return super().create_local_plan()
        self.plan = self._reuse
        return SavePlan([], usable=False)  # DCP's own answer for an unchanged local plan

    def transform_object(self, write_item: Any, object: Any) -> Any:
        if isinstance(object, Serialized):
            return io.BytesIO(object)
        return super().transform_object(write_item, object)


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


def _narrow(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The chunk at ``offsets`` of ``sizes`` inside ``tensor`` (a view)."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    return tensor


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


#: This process, as other ranks' workers know it (a pid can be reused; this cannot).
_PROCESS_ID = uuid.uuid4().hex


def _all_layouts(process_group: Any, signature: tuple | None) -> str | None:
    """One digest of every rank's (``_PROCESS_ID``, digest of its plan signature), the same
    on every rank; None if any rank's signature is None. Rank 0 gathers and broadcasts it
    (O(N) in all; an all-gather handed every rank all N ranks' digests)."""
    import torch.distributed as dist

    from asyncckpt.cluster import dist as _dist

    rank = dist.get_rank(process_group)
    mine = (_PROCESS_ID, None if signature is None else signature_digest(signature))
    ranks = _dist.gather(process_group, mine, dist.get_world_size(process_group), rank)
    combined = None
    if ranks is not None and all(d is not None for _, d in ranks):
        combined = signature_digest(tuple(ranks))
    return _dist.broadcast(process_group, combined)


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
    if plan_cache is not None and hasattr(planner, "_enable_plan_caching"):
        # DCP's own check of an unchanged local plan ignores dtypes, so its cache is only
        # turned on under a key that covers the whole layout (``cachekeys``). Across ranks the
        # key covers every rank's layout and process: the coordinator plans afresh only when
        # its own key is new, so any rank's change must change the key everywhere; and DCP's
        # caching assumes the coordinator holds the plans every other rank skips sending,
        # which a restarted worker (its caches empty) would break.
        signature = dcp_plan_signature(flat, Serialized, object_paths)
        layout: Any = signature
        if not no_dist:
            ranks = _all_layouts(process_group, signature)
            layout = None if ranks is None else (signature, ranks)
        if layout is not None:  # the same on every rank: a rank's None disables it everywhere
            name = f"asyncckpt:{type(planner).__name__}:{plan_cache}"
            planner._enable_plan_caching = True
            planner._cached_plans_key = _PLAN_KEYS.key(name, layout, dcp_plan_caches())
    with _quiet_single_process(), stateful_entries_as_is():
        dcp.save(
            dict(flat),
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
        )
    return writer.crcs


#: The last ``dcp_object_paths`` answer: a worker gets the same paths object save after save.
_last_object_paths: tuple[Any, dict[str, tuple]] = (None, {})


def dcp_object_paths(paths: Mapping[str, list] | None) -> dict[str, tuple]:
    """DCP's object path of each key (``.metadata``'s ``planner_data``), from the typed paths
    of ``staging.flatten_state``: dict keys as ``str`` (DCP's ``traverse_state_dict`` makes
    them so), list indices as ``int``."""
    global _last_object_paths
    if not paths:
        return {}
    last, out = _last_object_paths
    if paths is last:
        return out
    out = {k: tuple(i if kind == "l" else str(i) for kind, i in p) for k, p in paths.items()}
    _last_object_paths = (paths, out)
    return out


# ---------------------------------------------------------------------------------- loading


#: The last few ``.metadata`` files read, by (path, inode, mtime, size): a load reads the
#: metadata for the pre-load check, for the targets and for DCP itself; for a state of 20,000
#: tensors each unpickling takes ~0.5 s. Committed checkpoints never change in place.
_METADATA_CACHE: OrderedDict[tuple, Any] = OrderedDict()
_METADATA_CACHE_SIZE = 2
_metadata_lock = threading.Lock()


def read_dcp_metadata(directory: str | os.PathLike) -> Any:
    """DCP's ``Metadata`` of the checkpoint in ``directory`` (read once, then cached)."""
    key = metadata_file_key(Path(directory) / L.DCP_METADATA)
    with _metadata_lock:
        if key in _METADATA_CACHE:
            _METADATA_CACHE.move_to_end(key)
            return _METADATA_CACHE[key]
    metadata = FileSystemReader(directory).read_metadata()
    with _metadata_lock:
        _METADATA_CACHE[key] = metadata
        while len(_METADATA_CACHE) > _METADATA_CACHE_SIZE:
            _METADATA_CACHE.popitem(last=False)
    return metadata


class CachedMetadataReader(FileSystemReader):
    """DCP's reader, with the metadata from ``read_dcp_metadata`` (not unpickled again), and
    tensors read from their records straight into the targets (``records.place_record``).

    DCP's own ``read_data`` runs ``torch.load`` on every record (unpickling, a new storage)
    and copies the result into the target: for 20,000 small tensors that is most of a load,
    for large ones a second copy of every byte. Here each file is read once, in large parallel
    reads (``wholefiles``): a tensor's bytes go straight into the target when the request covers
    the whole stored tensor, and into a new tensor that is narrowed and copied as DCP does
    otherwise. Stream extensions (compression) leave the reading to DCP.

    ``verify`` (file name -> its manifest entry): those files are read whole and their
    checksums computed on the bytes as they arrive, instead of a separate pass over them
    before the load. A file that fails its entry fails the read (``ChecksumMismatch``, kept in
    ``damage``: DCP wraps what a reader raises) before anything is applied but the bytes of
    tensors read in place; objects, copies into targets and DCP's commits come after.
    ``verified`` names the files checked.
    """

    def __init__(
        self, path: str | os.PathLike, *, verify: Mapping[str, Any] | None = None, **kw: Any
    ) -> None:
        super().__init__(path, **kw)
        self.verify = dict(verify or {})
        self.verified: set[str] = set()
        self.damage: ChecksumMismatch | None = None
        self.declined: hotread.HotDeclined | None = None  # a hot read not applied

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kw: Any):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kw)
        self._metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from asyncckpt.formats.precheck import before_target  # (precheck imports this package)

        infos = [self.storage_data[item.storage_index] for item in plan.items]
        hot = hotread.current()  # a hot resume: tensor bytes from a surviving worker's memory
        if any(info.transform_descriptors for info in infos):
            if hot is not None:
                self._settle(hot, {"": "compressed records are not read from memory"})
            self._check_first()  # DCP's reader reads them: checked before, apart
            before_target()  # the load's own check, if it still runs (precheck.Pending)
            return super().read_data(plan, planner)
        # (A hot read checks the files this rank wrote or reads: the other ranks check theirs.)
        mine = [n for n in self.verify if hot is None or hot.owns(n)]
        per_file: dict[str, list[tuple[Any, Any, Any]]] = {name: [] for name in mine}
        for item, info in zip(plan.items, infos, strict=True):
            per_file.setdefault(info.relative_path, []).append((info.offset, item, info))
        with_crc = torch_computes_crc()
        files: list[wholefiles.FileRead] = []
        todo: list[tuple[wholefiles.FileRead, Any, Any]] = []
        applies: list[Callable[[], None]] = []
        try:
            for name, items in per_file.items():
                fd = os.open(os.path.join(self.path, name), os.O_RDONLY)
                f = wholefiles.FileRead(name, fd, os.fstat(fd).st_size, want=self.verify.get(name))
                files.append(f)
                if f.want is not None and f.size != f.want.get("size"):
                    problem = entry_problem(name, f.want, f.size, None)  # grown or truncated
                    self._fail({name: problem or f"{name}: size {f.size}"})
                for _, item, info in sorted(items, key=operator.itemgetter(0)):
                    todo.append((f, item, info))
            # Where each record's bytes are (a few small reads each: in parallel, cold they
            # are a disk's round trips), then their places in the files, in this thread.
            places = _in_parallel(
                lambda job: self._where(job[0], job[1], job[2], with_crc, hot), todo
            )
            for (f, item, info), where in zip(todo, places, strict=True):
                if where is not None:
                    count(where)
                applies.append(self._place_item(f, item, info, where, planner))
            before_target()  # the load's own check, if it still runs (precheck.Pending)
            problems = wholefiles.read_files(files)
        finally:
            for f in files:
                os.close(f.fd)
        if hot is not None:
            self._settle(hot, problems)  # HotDeclined unless every rank matched: none applied
            hot.copy_all(wholefiles.read_threads())
        if problems:
            # Damage only against a manifest: without one a short file may be a reader's or
            # the machine's fault (the restorer quarantines damage alone).
            if any(name in self.verify for name in problems):
                self._fail(problems)
            raise EOFError("; ".join(problems.values()))
        self.verified.update(f.name for f in files if f.want is not None)
        for apply in applies:  # every file checked: the rest of the checkpoint goes in
            apply()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _settle(self, hot: hotread.HotRead, problems: Mapping[str, str]) -> None:
        try:
            hot.settle(problems)
        except hotread.HotDeclined as e:
            self.declined = e  # (DCP wraps what a reader raises: load_flat raises it as is)
            raise

    def _fail(self, problems: Mapping[str, str]) -> None:
        self.damage = ChecksumMismatch(
            f"{self.path}: " + "; ".join(problems.values()), list(problems.values())
        )
        raise self.damage

    def _check_first(self) -> None:
        from asyncckpt.formats.precheck import check_files

        found = check_files(self.path, self.verify)
        if found.damage:
            self._fail(dict(enumerate(found.damage)))  # type: ignore[arg-type]
        found.raise_any(self.path)  # an I/O error alone
        self.verified.update(self.verify)

    def _stored(self, item: Any) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of the stored chunk ``item`` reads."""
        md = self._metadata.state_dict_metadata[item.storage_index.fqn]
        offsets = tuple(item.storage_index.offset or ())
        chunk = next(
            (c for c in md.chunks if tuple(c.offsets) == offsets),
            md.chunks[0] if len(md.chunks) == 1 else None,
        )
        if chunk is None:
            raise ValueError(f"no stored chunk of {item.storage_index.fqn} at {offsets}")
        return tuple(chunk.sizes), md.properties.dtype

    def _where(
        self,
        f: wholefiles.FileRead,
        item: Any,
        info: Any,
        with_crc: bool,
        hot: hotread.HotRead | None = None,
    ) -> Placement | None:
        if item.type == LoadItemType.BYTE_IO:
            return None
        shape, dtype = self._stored(item)
        # A record whose bytes are in memory (hot): located, not read whole, however small.
        nbytes = math.prod(shape) * dtype.itemsize
        small = hot is None or hot.view(f.name, item.storage_index.fqn, nbytes) is None
        return place_record(
            f.fd, info.offset, info.length, dtype, shape, with_crc, read_small=small
        )

    def _place_item(
        self,
        f: wholefiles.FileRead,
        item: Any,
        info: Any,
        where: Placement | None,
        planner: LoadPlanner,
    ) -> Callable[[], None]:
        """Add where ``item``'s bytes go to ``f``'s spans; returns what applies it once read."""
        if where is None:  # a byte item: an object's pickle
            buf = bytearray(info.length)
            f.spans.append(wholefiles.Span(info.offset, memoryview(buf)))
            return lambda: planner.load_bytes(item, io.BytesIO(buf))
        shape, dtype = self._stored(item)
        target = planner.resolve_tensor(item).detach()
        whole = not any(item.storage_offsets) and tuple(item.lengths) == shape
        hot = hotread.current()
        # A hot read writes no target before every file matched: nothing is read in place.
        direct = whole and fits(target, dtype, shape) and hot is None

        def commit(tensor: torch.Tensor) -> None:
            if tensor is not target:
                tensor = _narrow(tensor, item.storage_offsets, item.lengths)
                if target.size() != tensor.size():
                    raise ValueError(
                        f"{item.storage_index.fqn}: stored {tuple(tensor.size())}, "
                        f"target {tuple(target.size())}"
                    )
                target.copy_(tensor)
            planner.commit_tensor(item, target)

        if where.record is not None and where.span is not None:
            # Read whole to recognise it: checksummed as it is, copied in once checked.
            record, (lo, hi) = where.record, where.span
            f.spans.append(wholefiles.Span(info.offset, memoryview(record), filled=True))

            def from_record() -> None:
                dst = target if direct else torch.empty(shape, dtype=dtype)
                tensor_bytes(dst)[:] = memoryview(record)[lo:hi]
                commit(dst)

            return from_record
        if where.at is not None and hot is not None:
            at = info.offset + where.at
            src = hot.view(f.name, item.storage_index.fqn, math.prod(shape) * dtype.itemsize)
            if src is not None and whole:
                # Checksummed in its place in the file; copied in once every file matched.
                f.spans.append(wholefiles.Span(at, src, filled=True))
                hot.from_memory += 1
                tensor = hot.stage(target, src, dtype, shape)  # (copied by hot.copy_all)
                return lambda: commit(tensor())
            hot.from_disk += 1
            dst = torch.empty(shape, dtype=dtype)
            f.spans.append(wholefiles.Span(at, tensor_bytes(dst)))
            return lambda: commit(dst)
        if where.at is not None:
            at = info.offset + where.at
            if direct:
                f.spans.append(wholefiles.Span(at, tensor_bytes(target)))
                return lambda: commit(target)
            if whole and _on_accelerator(target, dtype, shape):
                # Through this thread's pinned buffer into the device: no host tensor.
                f.spans.append(wholefiles.Span(at, target.view(-1).view(torch.uint8)))
                return lambda: commit(target)
            dst = torch.empty(shape, dtype=dtype)
            f.spans.append(wholefiles.Span(at, tensor_bytes(dst)))
            return lambda: commit(dst)
        buf = bytearray(info.length)  # torch.load's, as DCP reads it
        f.spans.append(wholefiles.Span(info.offset, memoryview(buf)))
        return lambda: commit(torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # a per-rank metadata file: not ours to cache
            return super().read_metadata(*args, **kwargs)
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


def _in_parallel(fn: Callable[[Any], Any], jobs: list[Any]) -> list[Any]:
    """``[fn(job) for job in jobs]`` by ``wholefiles.read_threads()`` threads."""
    threads = min(wholefiles.read_threads(), len(jobs))
    if threads < 2:
        return [fn(job) for job in jobs]
    with ThreadPoolExecutor(threads, thread_name_prefix="asyncckpt-place") as pool:
        return list(pool.map(fn, jobs))


def _on_accelerator(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """A contiguous tensor on an accelerator that a record's bytes can be copied into."""
    return (
        t.device.type not in ("cpu", "meta")
        and t.dtype == dtype
        and tuple(t.shape) == shape
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())
    )


def _paths_from_dcp(metadata: Any) -> dict[str, list[PathItem]]:
    # A checkpoint written by another tool: DCP's planner_data has the object path, with
    # dict keys as str and list indices as int.
    planner_data = metadata.planner_data or {}
    out = {}
    for fqn in metadata.state_dict_metadata:
        obj_path = planner_data.get(fqn, (fqn,))
        out[fqn] = [("l", k) if isinstance(k, int) else ("d", k) for k in obj_path]
    return out


def unflatten(flat: Mapping[str, Any], paths: Mapping[str, list]) -> dict[str, Any]:
    """Rebuild the nested state (dicts and lists, original key types) from flat leaves."""
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn) or [("d", fqn)]
        node: Any = root
        for i, (kind, key) in enumerate(path):
            last = i == len(path) - 1
            nxt_kind = None if last else path[i + 1][0]
            if kind == "l":
                while len(node) <= key:
                    node.append(None)
                if last:
                    node[key] = value
                else:
                    if node[key] is None:
                        node[key] = [] if nxt_kind == "l" else {}
                    node = node[key]
            else:
                if last:
                    node[key] = value
                else:
                    node = node.setdefault(key, [] if nxt_kind == "l" else {})
    return root


def read_flat(
    directory: str | os.PathLike,
    targets: Mapping[str, torch.Tensor] | None = None,
    *,
    process_group: Any = None,
    verify: Verify | None = None,
    only: Collection[str] | None = None,
) -> dict[str, Any]:
    """Read every entry of a DCP checkpoint (``only``: those named) into a flat dict.

    Where ``targets`` has a tensor of the same shape and dtype for a key, DCP reads straight
    into it (in place, no second copy); other tensors are freshly allocated on the CPU.
    """
    metadata = read_dcp_metadata(directory)
    targets = targets or {}
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if only is not None and fqn not in only:
            continue
        if isinstance(md, TensorStorageMetadata):
            t = targets.get(fqn)
            if (
                isinstance(t, torch.Tensor)
                and tuple(t.shape) == tuple(md.size)
                and t.dtype == md.properties.dtype
                and not t.requires_grad
            ):
                flat[fqn] = t
            else:
                flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            flat[fqn] = None  # replaced by the unpickled object
    load_flat(flat, directory, process_group=process_group, verify=verify)
    return flat


def load_flat(
    flat: dict[str, Any],
    directory: str | os.PathLike,
    *,
    planner: Any = None,
    process_group: Any = None,
    verify: Verify | None = None,
) -> None:
    """``dcp.load`` of a flat dict (DCP keys to tensors and placeholders), in place.

    ``dcp.load`` first asks every top-level entry whether it is ``Stateful`` (a runtime
    protocol check, ~25 us each: 0.5 s for 20,000 keys); a flat dict holds none, so its inner
    loader is called directly where torch has it.
    """

    reader = CachedMetadataReader(str(directory), verify=verify.files if verify else None)
    no_dist = process_group is None
    inner = inner_dcp_load()
    with _quiet_single_process(), _damage_of(reader):
        if inner is None:
            dcp.load(
                flat,
                storage_reader=reader,
                planner=planner,
                process_group=process_group,
                no_dist=no_dist,
            )
        else:
            inner(
                flat,
                storage_reader=reader,
                process_group=process_group,
                no_dist=no_dist,
                planner=planner,
            )
    if verify is not None:
        verify.done.update(reader.verified)


@contextmanager
def _damage_of(reader: CachedMetadataReader) -> Iterator[None]:
    """A file that failed its checksum raises as itself, not as the ``CheckpointException``
    DCP wraps it in (the restorer quarantines damage, not other read errors)."""
    try:
        yield
    except (Exception, CheckpointException):  # noqa: BLE001 - re-raised, or as the damage
        if reader.damage is not None:
            raise reader.damage from None
        if reader.declined is not None:
            raise reader.declined from None
        raise


def target_tensors(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of the caller's state by DCP key (Stateful objects via state_dict())."""
    try:
        return flatten_state(state).tensors
    except (TypeError, ValueError):
        return {}


def merge_into(target: Any, loaded: Any, where: str = "") -> Any:
    """Restore ``loaded`` into ``target`` in place where possible; returns the merged value.

    Tensors are copied into existing tensors of the same shape; Stateful objects get
    ``load_state_dict``; dicts are merged key by key (keys only in the checkpoint are added);
    a list that holds tensors (or, in the target, Stateful objects) is restored element by
    element when it has the target's length; anything else, a list of plain values included,
    is replaced by the checkpoint's value.
    """
    if is_stateful(target) and isinstance(loaded, Mapping):
        target.load_state_dict(loaded)
        return target
    if isinstance(target, torch.Tensor) and isinstance(loaded, torch.Tensor):
        if target is loaded:
            return target
        if target.shape == loaded.shape:
            with torch.no_grad():
                target.copy_(loaded)
            return target
        return loaded
    if isinstance(target, dict) and isinstance(loaded, Mapping):
        for k, v in loaded.items():
            target[k] = merge_into(target[k], v, f"{where}.{k}") if k in target else v
        return target
    if (
        isinstance(target, list)
        and isinstance(loaded, list)
        and len(target) == len(loaded)
        and (_holds_tensor(loaded) or any(is_stateful(t) for t in target))
    ):
        for i, v in enumerate(loaded):
            target[i] = merge_into(target[i], v, f"{where}.{i}")
        return target
    # A list of plain values is a value as saved: merging it element by element into the
    # target's list would keep the target's extra elements (or their extra dict keys).
    return loaded


def _holds_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, Mapping):
        return any(_holds_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v) for v in x)
    return False


def load_into(
    state: Any,
    directory: str | os.PathLike,
    paths: Mapping[str, list] | None,
    verify: Verify | None = None,
    target_only: bool = False,
) -> None:
    """Read the checkpoint in ``directory`` and restore it into ``state`` in place
    (``target_only``: only the entries ``state`` names, ``LoadOptions.target_only``)."""
    only = None
    if target_only:
        with contextlib.suppress(TypeError, ValueError):  # (not a mapping: read everything)
            named = flatten_state(state)
            only = {*named.tensors, *named.objects}
    flat = read_flat(directory, target_tensors(state), verify=verify, only=only)
    if paths is None:
        paths = _paths_from_dcp(read_dcp_metadata(directory))
    loaded = unflatten(flat, paths)
    if is_stateful(state):
        state.load_state_dict(loaded)
    else:
        merge_into(state, loaded)


# ------------------------------------------------------------------------------ the format


def local_piece(t: torch.Tensor, key: str, shards: dict, tensors: dict) -> None:
    """Stage ``t`` under ``key``: a DTensor as this rank's local piece (with where it sits in
    the global tensor, in ``shards``), any other tensor as it is."""
    if is_dtensor(t):
        shards[key] = (dtensor_shard_info(t), [key])
        tensors[key] = t.to_local()  # type: ignore[attr-defined]  # a DTensor (is_dtensor)
    else:
        tensors[key] = t


def assemble(views: Mapping[str, torch.Tensor], shards: Mapping[str, Any]) -> dict[str, Any]:
    """The staged views put back together: each sharded key's pieces as one ``LocalShard``."""
    flat: dict[str, Any] = {}
    grouped: set[str] = set()
    for key, (info, keys) in shards.items():
        flat[key] = LocalShard([views[k] for k in keys], info)
        grouped.update(keys)
    for k, v in views.items():
        if k not in grouped:
            flat[k] = v
    return flat


def dcp_entries(metadata: Any, *, objects_known: bool = True) -> Entries:
    """What a DCP checkpoint holds, from its ``Metadata`` (``FileSystemReader.read_metadata``)."""
    out = Entries(objects_known=objects_known)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out.leaves[fqn] = (tuple(md.size), md.properties.dtype)
        else:
            out.leaves[fqn] = None
    return out


class DCPFormat(Format):
    """Plain DCP: the state flattened to DCP keys, DTensors as their local pieces; loads at
    any world size (DCP reshards)."""

    name = "dcp"
    shared_by_ranks = True
    verifies_while_reading = True
    differential = True
    #: The files describing the checkpoint, read by the pre-load check.
    metadata_files = frozenset({L.DCP_METADATA})
    #: The DCP save planner's class (None: ``write_flat``'s default).
    planner: type | None = None

    def prepare(self, state: Any, options: SaveOptions) -> Prepared:
        cache = options.cache
        flat = cache.flatten(state) if cache is not None else flatten_state(state)
        tensors: dict[str, torch.Tensor] = flat.tensors
        shards: dict[str, tuple[ShardInfo, list[str]]] = {}
        key = flat.key
        if any(is_dtensor_type(t) for t in set(map(type, tensors.values()))):
            tensors, key = {}, None  # the local pieces are what is staged
            for fqn, t in flat.tensors.items():
                local_piece(t, fqn, shards, tensors)
        objects = serialize_objects(flat.objects)
        return Prepared(tensors, objects, flat.paths, {"shards": shards}, key=key)

    def write(self, part: Prepared, location: Path, options: WriteOptions) -> Crcs:
        flat: dict[str, Any] = {k: Serialized(v) for k, v in part.objects.items()}
        flat.update(assemble(part.tensors, part.extra.get("shards", {})))
        return write_flat(
            flat,
            location,
            thread_count=options.thread_count,
            threads_used=options.threads_used,
            pace=options.pace,
            direct_io=options.direct_io,
            process_group=options.process_group,
            planner=None if self.planner is None else self.planner(),  # None: the default
            plan_cache=options.plan_cache,
            object_paths=dcp_object_paths(part.paths),
            differential=options.differential if self.differential else None,
        )

    def load_into(self, state: Any, location: Path, paths: Paths, options: LoadOptions) -> None:
        load_into(state, location, paths, options.verify, options.target_only)

    def entries(self, state: Any, location: Path, options: LoadOptions) -> Entries | None:
        if not (location / L.DCP_METADATA).exists() or has_sharded_base(state):
            return None  # megatron's loader validates a sharded state dict itself
        return dcp_entries(read_dcp_metadata(location), objects_known=self.objects_known(location))

    def objects_known(self, location: Path) -> bool:
        """Whether ``.metadata`` lists the non-tensor leaves too."""
        return True

    def read_by_check(self, path: Path, location: Path) -> bool:
        return path.name in self.metadata_files and path.parent == location

    def read(self, location: Path, paths: Paths) -> dict[str, Any]:
        flat = read_flat(location)
        if paths is None:
            paths = _paths_from_dcp(read_dcp_metadata(location))
        return unflatten(flat, paths)
