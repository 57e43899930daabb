"""Shard types: where a rank's pieces sit in a global tensor, and the tensor that hands DCP
only those pieces.

``LocalShard`` lets a rank hand DCP only its own piece of a global tensor (a DTensor's local
shard, a megatron ``ShardedTensor``'s chunk) from plain staging memory, without a device mesh
or megatron in the worker process. The trainer describes its pieces (``ShardInfo``), the
worker builds the ``LocalShard`` from its staged views, the cache keys tell one apart.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncckpt._torch import make_wrapper_subclass


@dataclass(frozen=True)
class ShardInfo:
    """Where a rank's local pieces sit in a global tensor: one (offsets, sizes) per piece."""

    global_shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def dtensor_shard_info(t: Any) -> ShardInfo:
    """The global shape and this rank's chunk of a DTensor (no collective)."""
    chunk = t.__create_chunk_list__()[0]
    return ShardInfo(tuple(t.shape), ((tuple(chunk.offsets), tuple(chunk.sizes)),))


def _dtensor_class() -> type | None:
    """DTensor's class, or None while ``torch.distributed.tensor`` is not imported: no tensor
    can be a DTensor then, and importing it costs about a second and 40 MiB (its operator
    tables), which a trainer that holds no DTensor would pay at its first save."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls if isinstance(cls, type) else None


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def is_dtensor_type(cls: type) -> bool:
    """``is_dtensor`` for a type: one check for all the tensors of a type in a state."""
    dtensor = _dtensor_class()
    return dtensor is not None and issubclass(cls, dtensor)


class LocalShard(torch.Tensor):
    """A rank's piece(s) of a global tensor, for DCP's save planner (the _Checkpointable protocol).

    The global tensor is ``global_shape``; this rank holds ``pieces[i]`` at ``offsets[i]``.
    The pieces are plain tensors (views into the worker's staging arena).
    """

    _pieces: list[torch.Tensor]
    _offsets: list[torch.Size]

    @staticmethod
    def __new__(cls, pieces: Sequence[torch.Tensor], info: ShardInfo) -> LocalShard:
        r = make_wrapper_subclass(cls, torch.Size(info.global_shape), pieces[0].dtype)
        r._pieces = list(pieces)
        r._offsets = [torch.Size(off) for off, _ in info.chunks]
        return r

    def __init__(self, pieces: Sequence[torch.Tensor], info: ShardInfo) -> None:
        pass

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"LocalShard is only a carrier for DCP's planner, not {func}")

    def __create_write_items__(self, fqn: str, obj: Any, index: int | None = None) -> list:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        items = []
        for i, (piece, off) in enumerate(zip(self._pieces, self._offsets, strict=True)):
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, off, i if len(self._pieces) > 1 else None),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=off, sizes=piece.size()),
                        properties=TensorProperties.create_from_tensor(piece),
                        size=self.size(),
                    ),
                )
            )
        return items

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(offsets=off, sizes=p.size())
            for p, off in zip(self._pieces, self._offsets, strict=True)
        ]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        if index.index is not None and index.index < len(self._pieces):
            if self._offsets[index.index] == index.offset:
                return self._pieces[index.index]
        for p, off in zip(self._pieces, self._offsets, strict=True):
            if off == index.offset:
                return p
        raise ValueError(f"{index.fqn}: no local piece at offset {tuple(index.offset)}")

    def __repr__(self) -> str:  # the default repr would try to read data we do not have
        return (
            f"LocalShard(global={tuple(self.shape)}, offsets={[tuple(o) for o in self._offsets]})"
        )
