"""A DCP read whose tensor bytes come from a surviving worker's memory (hot resume).

The reader (``dcp.CachedMetadataReader``) reads as it always does, but where a tensor record
of a file this rank wrote has its bytes in the worker's arena, the arena's bytes take the place
of the file's: they are checksummed in their place in the file, with the rest of the file
(record headers, objects) read from the disk, and the result compared with the manifest's entry
for the file. Only once every file matched (and, with several ranks, every rank said its own
matched) is anything copied into the targets: a mismatch anywhere leaves the targets untouched
and the caller reads the same step from the disk (invariant 11).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch


class HotDeclined(Exception):
    """The hot read was not applied (nothing changed): read the same step from the disk."""


@dataclass
class HotRead:
    """The memory a read may take tensor bytes from.

    ``tensors``: DCP key -> the arena's bytes of that tensor as this rank wrote it;
    ``files``: the files this rank wrote (None: every file of the checkpoint); ``agree(ok)``:
    whether every rank's own files matched (one rank: ``ok``). Counts what came from where.
    """

    tensors: Mapping[str, memoryview]
    files: frozenset[str] | None
    agree: Callable[[bool], bool]
    from_memory: int = 0  # tensor records whose bytes came from memory
    from_disk: int = 0  # tensor records read from the disk (not in memory here)
    settled: bool = False
    copies: list[tuple[torch.Tensor, memoryview]] = field(default_factory=list)

    def stage(
        self, target: torch.Tensor, src: memoryview, dtype: torch.dtype, shape: tuple
    ) -> Callable[[], torch.Tensor]:
        """What goes into ``target``: ``src`` copied into it by ``copy_all`` when it is a
        contiguous tensor of ``dtype`` and ``shape`` (host or device), else ``src`` as a tensor
        (the caller copies it in). Returns the tensor, once copied."""
        if fits_in_place(target, dtype, shape):
            self.copies.append((target, src))
            return lambda: target
        return lambda: as_tensor(src, dtype, shape)

    def copy_all(self, threads: int) -> None:
        """The staged copies, by ``threads`` threads (the copies and their page faults on the
        mapped memory release the GIL)."""
        copies, self.copies = self.copies, []
        if threads < 2 or len(copies) < 2:
            for dst, src in copies:
                copy_bytes(dst, src)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="asyncckpt-hot") as pool:
            list(pool.map(lambda c: copy_bytes(*c), copies))

    def owns(self, name: str) -> bool:
        return self.files is None or name in self.files

    def view(self, name: str, fqn: str, nbytes: int) -> memoryview | None:
        """The memory holding the record of ``fqn`` in file ``name``, or None."""
        if not self.owns(name):
            return None
        src = self.tensors.get(fqn)
        return src if src is not None and len(src) == nbytes else None

    def settle(self, problems: Mapping[str, str]) -> None:
        """Every file read; raise ``HotDeclined`` unless they (and every rank's) matched."""
        self.settled = True
        ok = not problems
        if not self.agree(ok):
            why = "; ".join(problems.values()) if problems else "another rank's memory did not"
            raise HotDeclined(f"the memory did not match the manifest: {why}")


_current: ContextVar[HotRead | None] = ContextVar("asyncckpt_hot_read", default=None)


def current() -> HotRead | None:
    return _current.get()


@contextlib.contextmanager
def active(hot: HotRead) -> Iterator[HotRead]:
    token = _current.set(hot)
    try:
        yield hot
    finally:
        _current.reset(token)


def as_tensor(src: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes ``src`` as a tensor of ``dtype`` and ``shape`` (no copy; never written)."""
    if not len(src):
        return torch.empty(shape, dtype=dtype)
    return _frombuffer(src).view(dtype).view(shape)


def _frombuffer(src: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():  # mapped read-only: only ever read
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(src, dtype=torch.uint8)


#: A device copy goes through two reused pinned buffers of this size, in turn.
BOUNCE_BYTES = 64 << 20
_bounce = threading.local()


def copy_bytes(dst: torch.Tensor, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (a contiguous tensor of as many bytes), host or device."""
    flat = dst.view(-1).view(torch.uint8)
    if not len(src):
        return
    if flat.device.type == "cpu":
        flat.copy_(_frombuffer(src))
        return
    _to_device(flat, src)


def _to_device(flat: torch.Tensor, src: memoryview) -> None:
    """Host bytes (an arena mapped from another process: pageable) to an accelerator through
    reused pinned buffers: one fills while the other's copy runs on a side stream."""
    bufs = getattr(_bounce, "bufs", None)
    if bufs is None:
        bufs = [torch.empty(BOUNCE_BYTES, dtype=torch.uint8).pin_memory() for _ in range(2)]
        _bounce.bufs = bufs
    stream = torch.cuda.Stream(flat.device)
    stream.wait_stream(torch.cuda.current_stream(flat.device))  # what wrote ``flat`` before
    done: list[Any] = [None, None]
    for i, at in enumerate(range(0, len(src), BOUNCE_BYTES)):
        b = i % 2
        if done[b] is not None:
            done[b].synchronize()  # that buffer's previous copy has left it
        n = min(BOUNCE_BYTES, len(src) - at)
        bufs[b][:n].copy_(_frombuffer(src[at : at + n]))
        with torch.cuda.stream(stream):
            flat[at : at + n].copy_(bufs[b][:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        done[b] = event
    for event in done:
        if event is not None:
            event.synchronize()


def fits_in_place(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """``t`` takes bytes of ``dtype`` and ``shape`` by a plain copy into its own storage."""
    return (
        t.dtype == dtype
        and tuple(t.shape) == tuple(shape)
        and t.is_contiguous()
        and t.device.type != "meta"
        and not (t.is_conj() or t.is_neg())
    )
