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

A step the worker offers before it writes it (hot_serve.offer_staged: DCP, the memory
checkpoint persisted after the trainer's death) is taken before it is even on disk,
when it is newer than every committed step (the one ``load_latest`` picks once the commit is
done): from the memory alone (``hot_load``), every tensor checked against the checksum the
worker computed from its staged memory, objects and paths from the offer, no file read. Then
``load_latest`` itself (``settle``) waits for that worker (the engine's ``start()`` would wait
for it anyway) and checks that the step committed recording those very checksums (the
manifest's ``offered``; the worker checks after writing that its memory still held them); if
not, the state loaded is on no disk: it says so in the log and restores the whole target from
the newest committed step on disk, raising ``UncommittedResume`` only when none restores it.
A step that could not be taken so is read from disk once the worker is done
(``wait_for_worker``), never an older one meanwhile; once committed, such a step is read from
the memory alone too when its manifest records the checksums offered.

Several ranks: each rank checks the files it wrote against the memory its own worker offers,
then every rank says over the side store whether its own matched; only if all did does any
rank apply what it read, else all read the step from the disk: never a mix of sources that
was not checked whole. A step offered before it was written is taken on every rank or on
none, agreed over the old run's side store (hot_agree.py), before or after its commit (every
rank takes the same path), and every rank's ``start()`` checks its own part committed (the
manifest's ``offered_ranks``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import mmap
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asyncckpt.cluster import peer_gone
from asyncckpt.cluster.peerdata import Malformed
from asyncckpt.core import layout as _layout
from asyncckpt.errors import CheckpointError, StateMismatch, UncommittedResume
from asyncckpt.formats.hotread import HotDeclined, HotRead
from asyncckpt.formats.loadcheck import LoadReport
from asyncckpt.memory.hot_agree import agree, wait_count
from asyncckpt.memory.hot_load import HotSpoiled, load_offered
from asyncckpt.memory.hot_offer import HEADER, MAGIC, MAX_OFFER_BYTES, decode_offer
from asyncckpt.memory.hot_serve import DONE, TAKEN, Offer, peer_uid, socket_name
from asyncckpt.storage.localfs import lock_held, lock_path
from asyncckpt.storage.manifest import read_manifest

log = logging.getLogger("asyncckpt")

#: How long a client waits for a surviving worker's answer.
ASK_TIMEOUT_S = 5.0
#: How long a load waits for a worker of an earlier trainer to offer its step or end (its
#: deadline for what it was writing: ``WorkerConfig.orphan_deadline_s``, and some).
ORPHAN_WAIT_S = 630.0
#: The most arenas an offer maps (descriptors received at once).
MAX_ARENAS = 253

#: Read-only, shared, its page tables filled at once (not a fault per page later).
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

NO_WORKER = "no worker of an earlier trainer offers this rank's memory on this node"


class HotSource:
    """An offer received and mapped here: the tensors' bytes by DCP key (read-only use)."""

    def __init__(self, offer: Offer, maps: list[mmap.mmap], conn: socket.socket) -> None:
        self.offer = offer
        self.maps = maps
        self.conn = conn  # open while read: the worker waits for DONE before it ends
        views = [memoryview(m) for m in maps]
        self.tensors = {
            fqn: views[arena][at : at + n] for fqn, (arena, at, n) in offer.tensors.items()
        }
        self._views = views

    @property
    def step(self) -> int:
        return self.offer.step

    def close(self) -> None:
        """Let go: the worker's memory is freed once nobody maps it. Unmapped on a thread of
        its own (a GiB's page tables take a tenth of a second to tear down: not the load's)."""
        with contextlib.suppress(OSError):
            self.conn.sendall(DONE)
        self.conn.close()
        self.tensors = {}
        views, maps, self._views, self.maps = self._views, self.maps, [], []
        threading.Thread(target=_unmap, args=(views, maps), name="asyncckpt-unmap").start()


def _unmap(views: list[memoryview], maps: list[mmap.mmap]) -> None:
    for v in views:
        v.release()
    for m in maps:
        with contextlib.suppress(BufferError):  # a view still held: freed with it
            m.close()


def ask(
    root: Path, rank: int, at_work: Callable[[], bool] | None = None
) -> tuple[HotSource | None, str]:
    """The offer of a surviving worker of ``rank`` on ``root`` (this node), or None and why.
    An offer that is not what hot_serve.py sends (another user's process, a pickle, a header
    or a field out of place) is refused, logged, and the load reads the disk. ``at_work``:
    whether that worker is still at work (``_connect``), where the engine knows better than
    the locks say."""
    sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    assert sock is not None
    fds: list[int] = []
    try:
        sock.settimeout(ASK_TIMEOUT_S)
        if not _connect(sock, root, rank, at_work):
            return None, NO_WORKER
        if peer_uid(sock) != os.getuid():
            return None, "the process offering memory is another user's: not used"
        head, fds, flags, _ = socket.recv_fds(sock, HEADER.size, MAX_ARENAS)
        if flags & socket.MSG_CTRUNC:
            raise Malformed(f"refused the surviving worker's offer: over {MAX_ARENAS} descriptors")
        magic, length = HEADER.unpack(_exactly(sock, head, HEADER.size))
        if magic != MAGIC:
            raise Malformed(
                f"refused the surviving worker's offer: its header ({magic!r}) is not this "
                "asyncckpt's (a worker of another version, or another program)"
            )
        if length > MAX_OFFER_BYTES:
            raise Malformed(f"refused the surviving worker's offer: {length} bytes long")
        offer = decode_offer(_exactly(sock, b"", length), len(fds))
        _check_memory(fds, offer.sizes)
        maps = [
            mmap.mmap(fd, n, flags=MAP_FLAGS, prot=mmap.PROT_READ)
            for fd, n in zip(fds, offer.sizes, strict=True)
        ]
        sock.sendall(TAKEN)  # mapped: the worker may exit, the memory lives while mapped here
        source, sock = HotSource(offer, maps, sock), None
        return source, ""
    except Malformed as e:
        log.warning("rank %d: %s; reading from disk", rank, e)
        return None, str(e)
    except (OSError, EOFError, ValueError) as e:
        return None, f"asking the surviving worker failed: {e}"
    finally:
        for fd in fds:
            os.close(fd)
        if sock is not None:
            sock.close()


def _check_memory(fds: list[int], sizes: tuple[int, ...]) -> None:
    """Each descriptor is shared memory (a regular file: a pipe or a device is not mapped) at
    least as large as its arena, else ``Malformed``."""
    for i, (fd, n) in enumerate(zip(fds, sizes, strict=True)):
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < n:
            raise Malformed(
                f"refused the surviving worker's offer: descriptor {i} is not its arena's "
                f"memory ({'a regular file' if stat.S_ISREG(st.st_mode) else 'not a file'} of "
                f"{st.st_size} bytes, {n} offered)"
            )


def _connect(
    sock: socket.socket, root: Path, rank: int, at_work: Callable[[], bool] | None = None
) -> bool:
    """Connect to the surviving worker's offer; while a worker of an earlier trainer is still
    at work (its lock held, no engine holding the rank's; or ``at_work()``: an engine that
    started without waiting for it), wait for it to offer or to end: it may be about to offer
    a step newer than any committed (hot_serve.offer_early), and a load meanwhile would
    restore an older one."""
    deadline = time.monotonic() + ORPHAN_WAIT_S
    busy = at_work if at_work is not None else lambda: _orphan_at_work(root, rank)
    while True:
        try:
            sock.connect(socket_name(root, rank))
            return True
        except (ConnectionRefusedError, FileNotFoundError):
            if not busy() or time.monotonic() > deadline:
                return False
        time.sleep(0.01)


def _orphan_at_work(root: Path, rank: int) -> bool:
    return not lock_held(lock_path(root, f"rank{rank}")) and lock_held(
        lock_path(root, f"worker{rank}")
    )


def _exactly(sock: socket.socket, have: bytes, n: int) -> bytes:
    parts, got = [have], len(have)
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the surviving worker hung up mid-offer")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


#: Blocks until the worker of an earlier trainer of (root, rank) is done: what it was
#: committing is committed, or not, for good (``supervisor.wait_for_worker``, handed in by the
#: trainer, which owns the locks it waits on).
WaitForWorker = Callable[[Path, int], None]


class HotResume:
    """One engine's hot resumes (``Restorer.hot``): per ``load_latest``, the offer asked for,
    the decision, the ranks' vote. ``vote_cfg``: the side store's ``dist.DistConfig`` once
    the engine started (several ranks agree over it). ``wait_for_worker``: how a load waits
    for a worker that may still commit the step it offered (``WaitForWorker``)."""

    def __init__(
        self, root: Path, rank: int, world_size: int, *, wait_for_worker: WaitForWorker
    ) -> None:
        self.root, self.rank, self.world_size = root, rank, world_size
        self.wait_for_worker = wait_for_worker
        self.vote_cfg: Any = None
        # Every rank calls load_latest together (node-local roots: local_load.StepAgreement):
        # rank 0 then waits for every rank's word, even after its own "no".
        self.together = False
        self.loads = 0  # load_latest calls: every rank's n-th vote is about the same load
        self.source: HotSource | None = None
        self.reason = ""
        self.voted = False
        self.tried = False
        self.store: Any = None
        # A step taken before its worker wrote it: (step, its tensors' checksums), checked by
        # the same load once that worker is done (settle).
        self.pending: tuple[int, dict[str, int]] | None = None
        # Why such a step did not stand (its commit failed...): the target is on no disk.
        self.uncommitted = ""
        # A memory that failed its checksums as it was copied into the target (hot_load
        # ``HotSpoiled``): the load must restore the whole target from disk, or fail.
        self.spoiled = False

    @contextlib.contextmanager
    def session(self, at_work: Callable[[], bool] | None = None) -> Iterator[HotResume]:
        """Around one ``load_latest``: ask for the offer, and let it go after (``at_work``:
        ``ask``'s)."""
        self.loads += 1
        self.voted = self.tried = self.spoiled = False
        self.pending, self.uncommitted = None, ""  # (each load settles what it took)
        self.source, self.reason = ask(self.root, self.rank, at_work)
        if self.source is None and self.world_size > 1:
            # The other workers of its old run may wait for this rank's (peer_gone.py).
            peer_gone.announce_if_gone(self.root, self.rank)
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
            if not self.reason and self._offered_as_committed(path):
                try:  # its memory alone, no file
                    return self._load_offered_committed(state, strict)
                except HotDeclined as e:  # the same step's files restore the whole target
                    self.spoiled, self.reason = isinstance(e, HotSpoiled), str(e)
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

    def before_commit(
        self,
        load_dir: Callable[..., LoadReport],
        state: Any,
        strict: bool,
        committed: Callable[[], list],
    ) -> tuple[int, LoadReport] | None:
        """A step the surviving worker offered before writing it, newer than every one
        ``committed()``: the step a load picks once that commit is done. Loaded from memory
        (``load_committing``), or None once that worker is done (the disk then has it, or
        not: never an older step while it may still commit). The root is scanned only when
        such an offer came (a load's own scans stay as they were)."""
        src = self.source
        if src is not None and src.offer.world_size != self.world_size:
            # A run of another size: never from memory. Its commit first, if it is newer.
            newest = max((c.step for c in committed()), default=None)
            if src.offer.staged is None or (newest is not None and src.step <= newest):
                return None
            taken = None
        elif src is not None and self.world_size > 1 and src.offer.vote is not None:
            taken = self._on_every_rank(state, strict, committed)
        elif src is None or src.offer.staged is None:
            return None
        else:
            newest = max((c.step for c in committed()), default=None)
            if self.committing(newest) is not None:
                taken = self.load_committing(state, strict)
            elif self.world_size > 1 and (newest is None or src.step > newest):
                taken = None  # several ranks, no vote to agree over: not taken
            else:
                return None  # committed by now
        if taken is None:
            self.wait_for_worker(self.root, self.rank)
        return taken

    def committing(self, newest: int | None) -> Offer | None:
        """The offer of a step being written and committed, newer than ``newest`` (the newest
        committed): the step ``load_latest`` picks once that commit is done."""
        src = self.source
        if src is None or src.offer.staged is None:
            return None
        if self.world_size > 1:
            return None  # (offered early by one rank's worker only: hot_serve.offer_staged)
        if newest is not None and src.step <= newest:
            return None  # committed by now (or older): the usual path
        return src.offer

    def _on_every_rank(
        self, state: Any, strict: bool, committed: Callable[[], list]
    ) -> tuple[int, LoadReport] | None:
        """Several ranks, each offered its part before it was written (hot_agree.py): copied
        from memory here, kept only if every rank's was (else None, the reason kept, the
        offer let go; a target already written must then be restored whole from disk). The
        step is taken whether or not its commit is over yet: every rank takes one path."""
        src = self.source
        assert src is not None
        offer, report = src.offer, None
        newest = max((c.step for c in committed()), default=None)
        if offer.staged is None:
            why = f"this rank's worker offers step {offer.step} only once written"
        elif newest is not None and offer.step < newest:
            why = f"the surviving worker holds step {offer.step}; the newest committed is {newest}"
        else:
            try:
                report = load_offered(state, offer, src.tensors, strict)
            except StateMismatch:
                agree(offer, self.rank, self.world_size, False)
                self.voted = True
                raise  # the caller's mistake: the disk's copy of the step would not fit either
            except Exception as e:  # noqa: BLE001 - said to the other ranks: the disk, after it
                self.spoiled = isinstance(e, HotSpoiled)  # host targets partly written
                why = str(e)
        agreed, heard = agree(offer, self.rank, self.world_size, report is not None)
        self.voted = True
        if report is None or not agreed:
            if report is not None:
                self.spoiled, why = True, heard  # this rank's target holds the memory
            self.reason = f"step {offer.step}, offered before it was written, not applied: {why}"
            log.warning("%s; reading from disk once the commit is over", self.reason)
            src.close()
            self.source = None
            return None
        self.pending = (offer.step, _offered(offer))
        report.source = "memory"
        report.source_reason = (
            "taken before it was written, on every rank (its commit checked at start())"
        )
        return offer.step, report

    def load_committing(self, state: Any, strict: bool) -> tuple[int, LoadReport] | None:
        """The step offered before it was written, from the memory alone, checked against the
        offered checksums; None (the reason kept, the offer let go) when it was not applied:
        the caller reads the disk once the worker is done."""
        src = self.source
        assert src is not None and src.offer.staged is not None
        step = src.step
        try:
            report = load_offered(state, src.offer, src.tensors, strict)
        except StateMismatch:
            raise  # the caller's mistake: the disk's copy of the step would not fit either
        except Exception as e:  # noqa: BLE001 - the disk, after it
            self.spoiled = isinstance(e, HotSpoiled)  # host targets partly written
            self.reason = f"step {step}, taken before it was written, was not applied: {e}"
            log.warning("%s; reading from disk once the commit is over", self.reason)
            src.close()
            self.source = None
            self.voted = False  # (one rank: its word was its own)
            return None
        self.pending = (step, _offered(src.offer))
        report.source = "memory"
        report.source_reason = "taken before it was written (its commit checked at start())"
        return step, report

    def settle(self, layout: str, *, started: bool) -> bool:
        """After this load took a step before its worker wrote it (``pending``): wait for that
        worker (unless the engine's ``start()`` did: ``started``) and check that the step
        committed as loaded (``_not_committed``). True: the load stands. False: the target
        holds a step on no disk (why: ``uncommitted``, said in the log); the caller restores
        the whole target from the disk (``spoiled``), or raises."""
        pending, self.pending = self.pending, None
        if pending is None:
            return True
        if not started:
            self.wait_for_worker(self.root, self.rank)
        why = self._not_committed(pending, layout)
        if why is None:
            log.info("step %d, loaded before it was written, is committed", pending[0])
            return True
        self.spoiled = True
        self.uncommitted = self.reason = (
            f"step {pending[0]} was loaded from the memory of the worker of an earlier trainer "
            f"before that worker wrote it, and {why}"
        )
        log.warning("%s: reading the newest committed step from disk instead", self.reason)
        if self.source is not None:
            self.source.close()
            self.source = None
        return False

    def settle_later(self, layout: str, wait: Callable[[], None]) -> None:
        """``settle``, for an engine that started without waiting for the worker writing the
        step this load took (trainer/earlier_worker.py): the load stands now, and a thread
        waits for that worker and checks the commit. The target holds that step's
        bytes whatever the outcome (every tensor matched the checksums the worker computed
        from its memory); if the step did not commit as loaded, the log says so: until this
        engine's next save commits, the newest step on disk is an older one."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        threading.Thread(
            target=self._check_later, args=(pending, layout, wait), daemon=True,
            name="asyncckpt-hot-commit-check",
        ).start()  # fmt: skip

    def _check_later(
        self, pending: tuple[int, dict[str, int]], layout: str, wait: Callable[[], None]
    ) -> None:
        try:
            wait()
            why = self._not_committed(pending, layout)
        except Exception as e:  # noqa: BLE001 - said in the log, on a thread of its own
            why = f"its commit could not be checked: {e}"
        if why is None:
            log.info("step %d, loaded before it was written, is committed", pending[0])
            return
        log.warning(
            "step %d was loaded from the memory of the worker of an earlier trainer before "
            "that worker wrote it, and %s: training goes on from it (its bytes were checked), "
            "but until this engine's next save commits, the newest step on disk is older",
            pending[0],
            why,
        )

    def check_committed(self, layout: str) -> None:
        """At ``start()``: a step taken before it was written and not settled by its load (none
        is: ``settle``) is committed as loaded, else ``UncommittedResume``."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        why = self._not_committed(pending, layout)
        if why is not None:
            raise UncommittedResume(
                f"step {pending[0]} was loaded from the memory of the worker of an earlier "
                f"trainer before that worker wrote it, and {why}: the state loaded is on no "
                "disk. Load again (load_latest) before training on."
            )

    def _not_committed(self, pending: tuple[int, dict[str, int]], layout: str) -> str | None:
        """Why the step taken before it was written (``pending``: it and its checksums) is not
        committed recording the checksums it was checked against (the manifest's ``offered``:
        the worker checks its files were written from those bytes), or None: it is."""
        step, crcs = pending
        found = {c.step: c.path for c in _layout.scan(self.root, layout)}.get(step)
        why = None
        if found is None:
            why = "its commit failed (the worker's log says why)"
        else:
            try:
                manifest = read_manifest(found)
                recorded = (
                    manifest.get("offered")
                    if self.world_size == 1
                    else manifest.get("offered_ranks", {}).get(str(self.rank))
                )
                if recorded != crcs:
                    why = "it committed other bytes than those loaded"
            except CheckpointError as e:
                why = f"its manifest cannot be read: {e}"
        return why

    def _offered_as_committed(self, path: Path) -> bool:
        """The committed step at ``path`` is the one offered before it was written, with the
        very checksums offered: its memory alone is read (no file)."""
        src = self.source
        if src is None or src.offer.staged is None or self.world_size > 1:
            return False
        try:
            return bool(read_manifest(path).get("offered") == _offered(src.offer))
        except CheckpointError:
            return False  # the disk path says what is wrong with it

    def _load_offered_committed(self, state: Any, strict: bool) -> LoadReport:
        assert self.source is not None
        report = load_offered(state, self.source.offer, self.source.tensors, strict)
        report.source = "memory"
        return report

    def _refusal(self, step: int) -> str | None:
        src = self.source
        if src is None:
            return self.reason
        if src.offer.world_size != self.world_size:
            return (
                f"the surviving worker's run had {src.offer.world_size} rank(s), this one "
                f"{self.world_size}: its memory is one rank's part of that run's step"
            )
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
            # Counters, not a key per rank that every rank reads: O(1) requests per rank
            # (N^2 in all before: 10^8 at 10,000 ranks). A "no" is counted before the vote.
            store.add(prefix + "no", 0 if ok else 1)
            if store.add(prefix + "voted", 1) == self.world_size:
                store.set(prefix + "all", b"1")  # the last voter lets the waiting ones go
            agreed = False
            if ok:  # (a "no" needs no other word: a rank loading alone never waits here)
                store.wait([prefix + "all"], datetime.timedelta(seconds=cfg.timeout))
                agreed = store.add(prefix + "no", 0) == 0
            store.add(prefix + "heard", 1)
            if self.rank == 0 and (ok or self.together):  # its worker serves the store:
                # the others use it first (after a "no", only where every rank loads:
                # elsewhere a rank may load alone)
                heard = wait_count(store, prefix + "heard", self.world_size, cfg.timeout)
                with contextlib.suppress(Exception):  # (kept, if not: 4 keys per load)
                    for k in ("no", "voted", "all", "heard") if heard else ():
                        store.delete_key(prefix + k)  # every rank has read its answer
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


def _offered(offer: Offer) -> dict[str, int]:
    """The checksums an offer made before writing carries (the manifest's ``offered``)."""
    return {fqn: crc for fqn, (_, _, crc) in (offer.staged or {}).items()}
