"""``engine.protect(step)`` seen by other processes: ``python -m asyncckpt prune`` honours it.

A live engine's pins are also written to a small file under its root,
``.asyncckpt-pins.rank<r>.json`` (the engine's pid and its protected steps): whole (a
temporary renamed over it) at each ``protect`` and at the engine's start, removed when it
stops. A file counts only while its engine lives: that rank's lock on the root (``rank<r>``,
an flock the engine takes at its start and the kernel drops at its end, a kill included) is
held, by the pid the file names (the lock file notes its holder's pid). A killed engine's
file is thus ignored, also from another host of a shared filesystem, and a later engine of
that rank does not inherit it.

A ``protect`` and each deletion of a prune from outside the engine (``deleting``) hold the
root's ``pins`` lock: a pin written before a deletion starts is seen by it, and ``protect``
waits for one deletion at most. No torch here: the CLI imports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

from asyncckpt.storage import localfs
from asyncckpt.storage.local import LocalStore

log = logging.getLogger("asyncckpt")

_PREFIX = ".asyncckpt-pins.rank"
_NAME = re.compile(r"^\.asyncckpt-pins\.rank(\d+)\.json$", re.ASCII)
#: The root's lock a pin's write and a deletion from outside the engine both hold.
PINS_LOCK = "pins"


def pin_file(root: str | os.PathLike, rank: int) -> Path:
    return Path(root) / f"{_PREFIX}{rank}.json"


@contextlib.contextmanager
def _pins_locked(root: str | os.PathLike) -> Iterator[None]:
    """The root's ``pins`` lock, or none where it cannot be had (a root this process may
    only read: it deletes nothing there either; a filesystem without flock)."""
    try:
        fd = LocalStore(root).lock(PINS_LOCK, wait=True)
    except OSError as e:
        log.debug("asyncckpt: no pins lock on %s: %s", root, e)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            localfs.unlock(fd)


def publish(root: str | os.PathLike, rank: int, steps: Iterable[int]) -> None:
    """Write this process's pins of ``rank`` on ``root`` (the engine holds ``rank<r>``).
    ``steps`` is read under the lock: of two threads' ``protect``, the last file written
    holds both pins."""
    with _pins_locked(root):
        note = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rank": rank,
            "steps": sorted(set(steps)),
        }
        localfs.write_note(pin_file(root, rank), json.dumps(note).encode())


def withdraw(root: str | os.PathLike, rank: int) -> None:
    """Remove the pins of ``rank`` on ``root`` (the engine stops; its lock goes next)."""
    with contextlib.suppress(FileNotFoundError):
        localfs.remove_tree(pin_file(root, rank))


def _holder_pid(root: Path, rank: int) -> int | None:
    """The pid ``rank<r>``'s lock file notes (its holder, when held); None if unreadable."""
    try:
        return int(localfs.lock_path(root, f"rank{rank}").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # (being noted this instant, or never)


def live_pins(root: str | os.PathLike) -> dict[int, list[tuple[int, int]]]:
    """The steps live engines protect on ``root``: step -> who, ``(rank, pid)`` of each.
    Files of engines that are gone are passed over (see the module's docstring)."""
    root = Path(root)
    try:
        names = sorted(e.name for e in os.scandir(root) if _NAME.match(e.name))
    except OSError:
        return {}
    out: dict[int, list[tuple[int, int]]] = {}
    for name in names:
        rank = int(_NAME.match(name).group(1))  # type: ignore[union-attr]
        try:
            note = json.loads((root / name).read_text())
            pid, steps = int(note["pid"]), [int(s) for s in note["steps"]]
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("asyncckpt: ignoring the unreadable pins file %s: %s", root / name, e)
            continue
        if not localfs.lock_held(localfs.lock_path(root, f"rank{rank}")):
            continue  # its engine is gone
        holder = _holder_pid(root, rank)
        if holder is not None and holder != pid:
            continue  # an earlier engine's: the one holding the root now is another
        for step in steps:
            out.setdefault(step, []).append((rank, pid))
    return out


@contextlib.contextmanager
def deleting(root: str | os.PathLike) -> Iterator[dict[int, list[tuple[int, int]]]]:
    """Around one deletion from outside the engines: the pins as they are now, none added
    until the block ends."""
    with _pins_locked(root):
        yield live_pins(root)
