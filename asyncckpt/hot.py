"""A hot resume, the trainer's side (hot_serve.py is the worker's): ``load_latest`` from the
shared memory of a worker that outlived its trainer, instead of the disk.

At the start of ``load_latest`` the restorer asks (``HotResume.session``): is there a worker
of this root and rank on this node offering a step? If it offers exactly the step
``load_latest`` picks from disk (the newest committed), that step is read with its tensor
bytes taken from the offered memory (``formats.hotread``): checksummed in their place in
their files against the committed manifest, and copied into the target only once every file
matched. Anything else reads the disk as before, and ``last_load_report`` says which path was
taken (``source``) and why not the other (``source_reason``):

* no worker offers memory (none survived, ``hold_seconds=0``, another node);
* it holds another step than the newest committed one;
* several ranks and no side store to agree over (a load before ``start()``);
* a format or a part the memory does not cover (components, another format than DCP);
* its bytes do not match the manifest (on any rank: then every rank reads the disk).

Several ranks: each rank checks the files it wrote against the memory its own worker offers,
then every rank says over the side store whether its own matched; only if all did does any
rank apply what it read, else all read the step from the disk: never a mix of sources that
was not checked whole.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import mmap
import os
import pickle
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .formats.hotread import HotDeclined, HotRead
from .hot_serve import HEADER, Offer, peer_uid, socket_name
from .loadcheck import LoadReport

log = logging.getLogger("asyncckpt")

#: How long a client waits for a surviving worker's answer.
ASK_TIMEOUT_S = 5.0
#: The most arenas an offer maps (descriptors received at once).
MAX_ARENAS = 253

NO_WORKER = "no worker of an earlier trainer offers this rank's memory on this node"


class HotSource:
    """An offer received and mapped here: the tensors' bytes by DCP key (read-only use)."""

    def __init__(self, offer: Offer, maps: list[mmap.mmap]) -> None:
        self.offer = offer
        self.maps = maps
        views = [memoryview(m) for m in maps]
        self.tensors = {
            fqn: views[arena][at : at + n] for fqn, (arena, at, n) in offer.tensors.items()
        }
        self._views = views

    @property
    def step(self) -> int:
        return self.offer.step

    def close(self) -> None:
        """Unmap: the worker's memory is freed once nobody maps it."""
        self.tensors = {}
        for v in self._views:
            v.release()
        for m in self.maps:
            with contextlib.suppress(BufferError):  # a view still held: freed with it
                m.close()
        self.maps = []


def ask(root: Path, rank: int) -> tuple[HotSource | None, str]:
    """The offer of a surviving worker of ``rank`` on ``root`` (this node), or None and why."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.settimeout(ASK_TIMEOUT_S)
        try:
            sock.connect(socket_name(root, rank))
        except (ConnectionRefusedError, FileNotFoundError):
            return None, NO_WORKER
        if peer_uid(sock) != os.getuid():
            return None, "the process offering memory is another user's: not used"
        head, fds, _, _ = socket.recv_fds(sock, HEADER.size, MAX_ARENAS)
        (length,) = HEADER.unpack(_exactly(sock, head, HEADER.size))
        offer: Offer = pickle.loads(_exactly(sock, b"", length))
        if len(fds) != len(offer.sizes):
            return None, "the offer came without its memory"
        # Read-only, shared, its page tables filled at once (not a fault per page later).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        maps = [
            mmap.mmap(fd, n, flags=flags, prot=mmap.PROT_READ)
            for fd, n in zip(fds, offer.sizes, strict=True)
        ]
        sock.sendall(b"T")  # mapped: the worker may exit, the memory lives while mapped here
        return HotSource(offer, maps), ""
    except (OSError, EOFError, pickle.UnpicklingError, ValueError) as e:
        return None, f"asking the surviving worker failed: {e}"
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()


def _exactly(sock: socket.socket, have: bytes, n: int) -> bytes:
    parts, got = [have], len(have)
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the surviving worker hung up mid-offer")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class HotResume:
    """One engine's hot resumes (``Restorer.hot``): per ``load_latest``, the offer asked for,
    the decision, the ranks' vote. ``vote_cfg``: the side store's ``dist.DistConfig`` once
    the engine started (several ranks agree over it)."""

    def __init__(self, root: Path, rank: int, world_size: int) -> None:
        self.root, self.rank, self.world_size = root, rank, world_size
        self.vote_cfg: Any = None
        self.loads = 0  # load_latest calls: every rank's n-th vote is about the same load
        self.source: HotSource | None = None
        self.reason = ""
        self.voted = False
        self.tried = False
        self.store: Any = None

    @contextlib.contextmanager
    def session(self) -> Iterator[HotResume]:
        """Around one ``load_latest``: ask for the offer, and let it go after."""
        self.loads += 1
        self.voted = self.tried = False
        self.source, self.reason = ask(self.root, self.rank)
        try:
            yield self
        finally:
            if not self.voted:
                self.vote(False)  # the other ranks may wait for this rank's word
            if self.source is not None:
                self.source.close()
                self.source = None

    def load(
        self, load_dir: Callable[..., LoadReport], state: Any, step: int, path: Path, strict: bool
    ) -> LoadReport:
        """``load_dir`` of the checkpoint ``step`` at ``path``: from memory when the worker
        offers that very step (the first one tried, the newest), else from the disk."""
        first, self.tried = not self.tried, True
        if first:
            self.reason = self._refusal(step) or ""
            if not self.reason:
                try:
                    report = load_dir(state, path, strict, step, hot=self._read())
                    report.source = "memory"
                    return report
                except HotDeclined as e:
                    self.reason = str(e)
            else:
                self.vote(False)
            if self.source is not None:
                log.warning("step %d: read from disk, not from memory: %s", step, self.reason)
        report = load_dir(state, path, strict, step)
        report.source_reason = self.reason if first else f"{self.reason} (step {step} older)"
        return report

    def _refusal(self, step: int) -> str | None:
        src = self.source
        if src is None:
            return self.reason
        if src.step != step:
            return f"the surviving worker holds step {src.step}; the newest committed is {step}"
        if self.world_size > 1 and self.vote_cfg is None:
            return "several ranks agree over the side store, which start() sets up"
        return None

    def _read(self) -> HotRead:
        assert self.source is not None
        files = frozenset(self.source.offer.files) if self.world_size > 1 else None
        return HotRead(self.source.tensors, files, self.vote)

    def vote(self, ok: bool) -> bool:
        """This rank's word (its own files matched: ``ok``); True when every rank's was."""
        if self.voted and self.world_size > 1:
            return False  # one word per load: a second attempt reads the disk
        self.voted = True
        if self.world_size == 1:
            return ok
        cfg = self.vote_cfg
        if cfg is None:
            return False
        prefix = f"asyncckpt/{cfg.token}/hot/{self.loads}/"
        try:
            store = self._client(cfg)
            store.set(prefix + str(self.rank), b"1" if ok else b"0")
            agreed = False
            if ok:  # (a "no" needs no other word: a rank loading alone never waits here)
                keys = [prefix + str(r) for r in range(self.world_size)]
                store.wait(keys, datetime.timedelta(seconds=cfg.timeout))
                agreed = all(store.get(k) == b"1" for k in keys)
            store.add(prefix + "heard", 1)
            if self.rank == 0 and ok:  # its worker serves the store: the others read first
                _wait_count(store, prefix + "heard", self.world_size, cfg.timeout)
            return agreed
        except Exception as e:  # noqa: BLE001 - no agreement: the disk, on every rank
            log.warning("rank %d: the ranks could not agree on a hot resume: %s", self.rank, e)
            return False

    def _client(self, cfg: Any) -> Any:
        if self.store is None:
            import torch.distributed as dist

            td = datetime.timedelta(seconds=cfg.timeout)
            self.store = dist.TCPStore(cfg.host, cfg.port, None, False, td)
        return self.store


def _wait_count(store: Any, key: str, n: int, timeout: float) -> None:
    """Until the counter ``key`` reaches ``n`` (every rank has read what it needed), at most
    ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while store.add(key, 0) < n and time.monotonic() < deadline:
        time.sleep(0.005)
