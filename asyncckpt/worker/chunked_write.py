"""The worker's side of chunked staging (chunked.py): write each chunk as the trainer fills it.

The checkpoint is a plain DCP checkpoint, written through DCP's planner and ``.metadata`` like
any other: only the order and the timing of the shard file's records differ. Every record of
the save goes into one shard file, in chunk order; before the records of chunk ``k`` the writer
waits until the trainer has copied it, and once they are in the file it gives the chunk's
buffer back. A tensor larger than a chunk is staged in slices of whole rows, and each slice is
written as a DCP chunk of that tensor (a ``dist.LocalShard`` with one piece per slice: its
offsets along dim 0 in ``.metadata``), the slices one after the other in the same file.
Why slices as DCP chunks rather than one ``torch.save`` record assembled from pieces: a record
is a zip archive whose header and CRCs cover the whole tensor, so writing one from slices
would mean rewriting torch's archive format; DCP chunks are how DCP itself stores a tensor in
pieces (sharded tensors), and plain ``dcp.load`` stitches them back into the whole tensor.
Nothing is committed unless every chunk arrived: the wait raises if the trainer gave the save
up or died, and the save fails like any failed write (its temporary removed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from asyncckpt import faults
from asyncckpt.core.savejob import SaveJob
from asyncckpt.core.shards import LocalShard, ShardInfo
from asyncckpt.formats.dcp import ChecksumWriter, _result, dcp_object_paths, write_flat
from asyncckpt.formats.records import torch_computes_crc
from asyncckpt.memory.service import WorkerView
from asyncckpt.staging.chunked import ChunkedPlan, ChunkSignals


def _bytes_view(arena: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype, shape: Any):
    """A tensor over arena bytes ``[start, start + nbytes)`` whose storage is exactly them
    (DCP clones a tensor whose storage is larger: torch.save writes whole storages)."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = memoryview(arena.numpy()).cast("B")[start : start + nbytes]  # type: ignore[arg-type]
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def chunk_views(arena: torch.Tensor, plan: ChunkedPlan) -> dict[str, torch.Tensor]:
    """Each tensor of ``plan`` as a view of where its bytes will be: a whole tensor in its
    chunk's buffer, a sliced one as a ``LocalShard`` of one piece per slice (the views of
    different chunks share a buffer: each is read only while its chunk is in it)."""
    pieces: dict[int, list[tuple[int, Any]]] = {}
    for k, chunk in enumerate(plan.chunks):
        for p in chunk.pieces:
            pieces.setdefault(p.index, []).append((k, p))
    out: dict[str, torch.Tensor] = {}
    for i, spec in enumerate(plan.tensors):
        parts = pieces.get(i, [])
        if len(parts) <= 1:
            start = plan.buffer_offset(parts[0][0]) + parts[0][1].offset if parts else 0
            nbytes = parts[0][1].nbytes if parts else 0
            out[spec.fqn] = _bytes_view(arena, start, nbytes, spec.dtype, spec.shape)
            continue
        views, chunks = [], []
        for k, p in parts:
            rows = p.nbytes // spec.row_bytes
            shape = (rows, *spec.shape[1:])
            start = plan.buffer_offset(k) + p.offset
            views.append(_bytes_view(arena, start, p.nbytes, spec.dtype, shape))
            offsets = (p.start // spec.row_bytes,) + (0,) * (len(spec.shape) - 1)
            chunks.append((offsets, shape))
        out[spec.fqn] = LocalShard(views, ShardInfo(spec.shape, tuple(chunks)))
    return out


class ChunkedWriter(ChecksumWriter):
    """DCP's storage writer for a save staged in chunks: one shard file, written in chunk
    order, each chunk once the trainer has copied it (see the module's docstring)."""

    def __init__(
        self,
        path: Path,
        plan: ChunkedPlan,
        signals: ChunkSignals,
        job_id: int,
        trainer_alive: Callable[[], bool],
        *,
        pace: Callable[[int], None] | None = None,
        direct_io: bool = False,
    ) -> None:
        super().__init__(path, thread_count=1, pace=pace, direct_io=direct_io)
        self.chunk_plan = plan
        self.signals = signals
        self.job_id = job_id
        self.trainer_alive = trainer_alive

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        byte_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        by_piece = {}
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                at = item.index.offset
                by_piece[(item.index.fqn, int(at[0]) if at else 0)] = item
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results: list[WriteResult] = []
        with_crc = torch_computes_crc()
        chunks = self.chunk_plan.chunks
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in byte_items:  # the pickled leaves first, as DCP orders a file
                offset = stream.tell()
                stream.write(self._data(item, planner).getbuffer())
                results.append(_result(item, name, offset, stream.tell() - offset))
            for k, chunk in enumerate(chunks):
                self.signals.wait_filled(self.job_id, k, self.trainer_alive)
                for p in chunk.pieces:
                    spec = self.chunk_plan.tensors[p.index]
                    item = by_piece[(spec.fqn, p.start // spec.row_bytes if p.start else 0)]
                    offset = stream.tell()
                    data = self._data(item, planner)
                    self.records.write(data, cast(BinaryIO, stream), with_crc)
                    results.append(_result(item, name, offset, stream.tell() - offset))
                stream.flush()  # every byte of the chunk out of its buffer
                self.signals.written(self.job_id, k + 1)
                if k < len(chunks) - 1:
                    faults.point("mid_chunk_write")
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


def trainer_alive(parent_pid: int) -> Callable[[], bool]:
    """Whether the trainer that spawned this worker still lives: a dead parent's children
    are re-parented."""
    return lambda: parent_pid <= 0 or os.getppid() == parent_pid


def write_chunked(
    worker: WorkerView,
    job: SaveJob,
    objects: dict[str, Any],
    directory: Path,
    process_group: Any = None,
) -> dict[str, tuple[int, int]]:
    """Write ``job`` (a save staged in chunks into its one arena of ``worker``) as DCP into
    ``directory``; returns the checksums per file. ``objects``: its pre-serialised leaves."""
    plan: ChunkedPlan = job.chunks
    arena = worker.arenas[job.arena_ids[0]]
    worker.io_threads.wrote_one_at_a_time()  # one file, chunk by chunk (SaveStats says so)
    writer = ChunkedWriter(
        directory,
        plan,
        ChunkSignals(arena),
        job.job_id,
        trainer_alive(worker.config.parent_pid),
        pace=worker.pacer,
        direct_io=worker.direct_io,
    )
    flat = dict(objects)
    flat.update(chunk_views(arena, plan))
    return write_flat(
        flat,
        directory,
        process_group=process_group,
        object_paths=dcp_object_paths(job.paths),
        writer=writer,
    )
