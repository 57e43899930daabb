"""Which bytes of which tensors go into each chunk of a staging budget (issue 35 item 2).

A state larger than ``Staging(max_host_bytes=)`` is to be staged through chunk buffers of a
fixed size, one after the other, each written by the worker before it is refilled. This module
is only the plan, a pure function of the tensors' sizes in staging order: the stager (trainer)
and the writer (worker) both follow it, so they agree on where each byte is without sending
offsets per save. Tensors stay whole where they fit in one chunk (a whole view is what
``torch.save`` records and the copy plans take); only a tensor larger than a chunk is cut, into
slices of whole chunks and a tail that shares its chunk with the tensors after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Where a piece starts inside its chunk is a multiple of this (as inside an arena).
ALIGN = 64


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of tensor ``index``, at ``offset`` in its chunk's buffer."""

    index: int
    start: int
    stop: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Chunk:
    pieces: tuple[Piece, ...]
    nbytes: int  # the buffer bytes this chunk uses (its last piece's end)


def plan_chunks(
    sizes: Sequence[int], chunk_bytes: int, quanta: Sequence[int] | None = None
) -> list[Chunk]:
    """The chunks of tensors of ``sizes`` bytes (staging order), each at most ``chunk_bytes``.

    Every byte of every tensor is in exactly one piece, in order; a tensor of at most
    ``chunk_bytes`` is one piece; ``chunk_bytes`` must be a positive multiple of ``ALIGN``.
    ``quanta``: a tensor that is cut is cut only at multiples of its quantum (the bytes of one
    row along its first dimension: each slice is then a block of whole rows, which DCP
    records as a chunk of the tensor); a quantum larger than ``chunk_bytes`` cannot be cut
    (``ValueError``). None: cut anywhere.
    """
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
    if quanta is not None and len(quanta) != len(sizes):
        raise ValueError(f"{len(quanta)} quanta for {len(sizes)} tensors")
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    used = 0

    def close() -> None:
        nonlocal pieces, used
        if pieces:
            chunks.append(Chunk(tuple(pieces), used))
        pieces, used = [], 0

    for index, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"tensor {index} has a negative size {size}")
        start = 0
        while True:
            offset = -(-used // ALIGN) * ALIGN
            room = chunk_bytes - offset
            left = size - start
            if left <= room:  # the rest fits here whole
                pieces.append(Piece(index, start, size, offset))
                used = offset + left
                break
            if size <= chunk_bytes or room <= 0:  # fits a chunk of its own: not cut
                close()
                continue
            if pieces:  # a tensor cut anyway starts on a fresh chunk: fewer, larger pieces
                close()
                continue
            quantum = max(1, quanta[index]) if quanta is not None else 1
            take = chunk_bytes - chunk_bytes % quantum
            if take == 0:
                raise ValueError(
                    f"tensor {index}: one row ({quantum} bytes) is larger than a chunk "
                    f"({chunk_bytes} bytes), so it cannot be cut into slices of whole rows"
                )
            pieces.append(Piece(index, start, start + take, 0))
            used = take
            start += take
            close()
    close()
    return chunks
