"""DCP's storage reader for our checkpoints: ``.metadata`` from the cache, each file read once
in large parallel reads, records placed straight into the targets, files checked against the
manifest while read; ``read_flat``, ``load_flat`` and ``load_into`` run DCP loads with it.
"""

from __future__ import annotations

import contextlib
import io
import math
import operator
import os
from collections.abc import Callable, Container, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from asyncckpt._torch import inner_dcp_load
from asyncckpt.core.entries import walk
from asyncckpt.core.tree import flatten_state, is_stateful, merge_into, target_tensors, unflatten
from asyncckpt.formats import hotread, wholefiles
from asyncckpt.formats.base import Verify
from asyncckpt.formats.dcp.metadata import paths_from_dcp, quiet_single_process, read_dcp_metadata
from asyncckpt.formats.precheck import before_target, check_files
from asyncckpt.formats.records import (
    Placement,
    count,
    fits,
    place_record,
    tensor_bytes,
    torch_computes_crc,
)
from asyncckpt.storage.manifest import ChecksumMismatch, entry_problem


def _narrow(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The chunk at ``offsets`` of ``sizes`` inside ``tensor`` (a view)."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    return tensor


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


def read_flat(
    directory: str | os.PathLike,
    targets: Mapping[str, torch.Tensor] | None = None,
    *,
    process_group: Any = None,
    verify: Verify | None = None,
    only: Container[str] | None = None,
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
    with quiet_single_process(), _damage_of(reader):
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


class Wanted:
    """The checkpoint keys a target asks for: the ones it names, and every key under one of
    its empty containers (a fresh optimizer's ``state`` is ``{}``: its moments are wanted
    all the same, as a load of the whole checkpoint would give them)."""

    def __init__(self, names: set[str], open_containers: set[str]) -> None:
        self.names = names
        self.prefixes = tuple(f"{p}." for p in open_containers)

    def __contains__(self, key: object) -> bool:
        return key in self.names or (isinstance(key, str) and key.startswith(self.prefixes))


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
            only = Wanted({*named.tensors, *named.objects}, walk(state).open)
    flat = read_flat(directory, target_tensors(state), verify=verify, only=only)
    if paths is None:
        paths = paths_from_dcp(read_dcp_metadata(directory))
    loaded = unflatten(flat, paths)
    if is_stateful(state):
        state.load_state_dict(loaded)
    else:
        merge_into(state, loaded)
