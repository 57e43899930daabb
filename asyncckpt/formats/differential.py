"""Differential saves, the worker's half: a shard file whose bytes would be the previous
checkpoint's is hard-linked from it instead of written again.

"Unchanged" is decided from the bytes the worker is about to write, never from version
counters or storage identity (invariant 15): every item of a file is fingerprinted with
xxh3-128 (CRC-32C is too weak to decide equality: a wrong "unchanged" is silent corruption),
and the file's fingerprint covers each item's key, place, type, dtype, shape and bytes, in the
order written, plus what else shapes the records (torch's version, the record CRC). Equal
fingerprints mean the file would be byte-identical to the one on disk, so linking it is exact.

Each rank's writer leaves a sidecar in the part's directory (``<prefix>fingerprints.json``),
covered by the manifest like any file: per shard file its fingerprint, size, whether it was
linked, and each item's (offset, length) so a linked file's ``WriteResult``s (``.metadata``
offsets) are the previous checkpoint's own. A hard link shares the inode: pruning the older
checkpoint unlinks a name, never the bytes a newer one holds; a corrupted shared file fails
the (copied) checksum of every checkpoint that holds it. A file is linked only after its bytes
pass that checksum (``try_link``): the new manifest's entry is then proven from the bytes, as a
written file's is, which the worker's prune relies on when it trusts the step it committed.

The trainer has already hashed most large CPU tensors' staged bytes, with this very function,
to decide which copies to skip (unchanged.py): the job carries those digests
(``SaveJob.digests``) and an item whose bytes are exactly a staged view (same address and
length in this process) takes its digest from there instead of being hashed again. That
passes a fact about the bytes, not an "unchanged" verdict: the trainer's "unchanged" is
relative to what its slot held, which need not be what the last *written* checkpoint holds
(slots alternate; a memory save is not written). The link is still decided here, against the
previous checkpoint's own file fingerprints.

Which checkpoint a save links from (``LinkSource``, ``link_source``): a hard link shares the
inode, so one damaged file fails every checkpoint that holds a name of it. When retention keeps
two or more steps, a save links only from a checkpoint that shares no file with some step the
prune after it keeps (``KeepRule.kept_beside``): then that kept step shares no file with the new
one either, and one damaged file leaves one of the two whole (invariant 19). With ``KeepLast(2)``
the two kept steps take turns: each save links from the step its prune removes.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from asyncckpt.core.layout import MANIFEST, dir_name, read_tracker, scan
from asyncckpt.core.walltime import OverlapClock
from asyncckpt.formats import format_of
from asyncckpt.retention import (
    SCOPES,
    CheckpointInfo,
    KeepAll,
    KeepEvery,
    KeepLast,
    KeepSteps,
    RetentionPolicy,
    Union,
    plan_prune,
)
from asyncckpt.staging.fingerprints import fingerprint_bytes
from asyncckpt.storage.local import read_checkpoint_info
from asyncckpt.storage.localfs import link_file, write_synced
from asyncckpt.storage.manifest import checksum_file, entry_problem

log = logging.getLogger("asyncckpt")

#: The sidecar's name after the rank's DCP file prefix (``__0_``).
SIDECAR = "fingerprints.json"
SIDECAR_VERSION = 1
#: Tensors at least this large get a file of their own, so that an unchanged one can be
#: linked whatever its neighbours do (a frozen base beside trained adapters).
OWN_FILE_BYTES = 1 << 20
#: Smaller items are packed, in key order, into files of about this size.
PACK_BYTES = 64 << 20


class FileFingerprint:
    """The running fingerprint of one file's items, in the order they are written."""

    def __init__(self, seed: str) -> None:
        self._h = xxhash.xxh3_128(seed.encode())

    def add(self, describe: str, data: Any, digest: bytes | None = None) -> None:
        """One item: what it is (key, place, type, dtype, shape) and its bytes' digest
        (``digest``: ``fingerprint_bytes(data)`` taken already, by the trainer)."""
        self._h.update(describe.encode() + b"\0" + (digest or fingerprint_bytes(data)))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def group_items(items: Iterable[Any], nbytes: Any, is_tensor: Any) -> list[list[Any]]:
    """Items into files so that whole files can be linked: deterministic for a layout.

    Large tensors (``OWN_FILE_BYTES``) one file each; everything else (objects, small
    tensors) packed in key order into files of ``PACK_BYTES``. ``nbytes(item)`` and
    ``is_tensor(item)`` describe an item; keys are ``item.index.fqn`` and offsets."""

    def key(item: Any) -> tuple:
        return (item.index.fqn, tuple(item.index.offset or ()))

    files: list[list[Any]] = []
    pack: list[Any] = []
    packed = 0
    for item in sorted(items, key=key):
        size = nbytes(item) if is_tensor(item) else 0
        if size >= OWN_FILE_BYTES:
            files.append([item])
            continue
        if pack and packed + size > PACK_BYTES:
            files.append(pack)
            pack, packed = [], 0
        pack.append(item)
        packed += size
    if pack:
        files.insert(0, pack)  # objects and small tensors first: file 0, as DCP's
    return files


@dataclass
class Previous:
    """The checkpoint a save may link from: ``directory`` (committed) and this save's
    temporary ``tmp`` (a part's place in one is its place in the other)."""

    directory: Path | None  # None: nothing to link from (the first save of this worker)
    tmp: Path
    #: (address, nbytes) of a staged view in this process -> ``fingerprint_bytes`` of its
    #: bytes, as the trainer took it (``known_digests``)
    known: Mapping[tuple[int, int], bytes] = field(default_factory=dict)

    def part(self, location: Path) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / Path(location).relative_to(self.tmp)


@dataclass
class Linker:
    """One rank's link-or-write decisions for one part (a DCP directory) of one save."""

    location: Path
    prefix: str
    previous: Path | None  # the same part in the previous checkpoint
    seed: str
    known: Mapping[tuple[int, int], bytes] = field(default_factory=dict)  # Previous.known
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    reused_bytes: int = 0  # bytes whose digest came from the trainer (not hashed here)
    fallbacks: list[str] = field(default_factory=list)
    _old: dict[str, Any] | None = None
    _old_manifest: dict[str, Any] | None = None
    _index: dict[str, tuple[str, dict[str, Any]]] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # wall time while any writer thread fingerprints a file (several at once: counted once)
    _hashing: OverlapClock = field(default_factory=OverlapClock)

    def __post_init__(self) -> None:
        if self.previous is None:
            return
        self._old = _read_json(self.previous / (self.prefix + SIDECAR))
        root = _checkpoint_root(self.previous)
        manifest = _read_json(root / MANIFEST) if root is not None else None
        if self._old is None or manifest is None or root is None:
            self._fallback(f"no fingerprints in {self.previous}: every file written")
            self._old = None
            return
        # The manifest names files from the checkpoint's top: a component's part is below it.
        rel = self.previous.relative_to(root)
        files = manifest.get("files", {})
        # The sidecar decides what is linked: trusted only as its manifest entry checksummed it.
        sidecar = (rel / (self.prefix + SIDECAR)).as_posix()
        want = files.get(sidecar)
        path = self.previous / (self.prefix + SIDECAR)
        try:
            problem = want is None or entry_problem(
                sidecar, want, path.stat().st_size, _crc_of(path)
            )
        except OSError as e:  # pruned meanwhile (another process's prune): nothing to link
            self._fallback(f"{path} went while read ({e}): every file written")
            self._old = None
            return
        if problem:
            self._fallback(f"{path} fails its manifest entry: every file written")
            self._old = None
            return
        self._old_manifest = {
            n: files[(rel / n).as_posix()]
            for n in self._old.get("files", {})
            if (rel / n).as_posix() in files
        }

    def _fallback(self, why: str) -> None:
        with self._lock:
            self.fallbacks.append(why)

    def timed_fingerprint(self, items: list[tuple[str, Any, tuple[int, int] | None]]) -> str:
        """A file's fingerprint from its items: (describe, bytes, where) with ``where`` the
        (address, nbytes) of the bytes in memory where they are a whole staged view's, else
        None; a staged view the trainer hashed is not hashed again."""
        with self._hashing.span():
            fp = FileFingerprint(self.seed)
            reused = 0
            for describe, data, where in items:
                known = self.known.get(where) if where is not None else None
                if known is not None and where is not None:
                    reused += where[1]
                fp.add(describe, data, known)
            digest = fp.hexdigest()
        with self._lock:
            self.reused_bytes += reused
        return digest

    @property
    def fingerprint_seconds(self) -> float:
        """Wall time spent fingerprinting this part's files."""
        return self._hashing.seconds

    def try_link(
        self, name: str, digest: str, count: int
    ) -> tuple[list[tuple[int, int]], tuple[int, int] | None] | None:
        """Link ``name`` from the previous checkpoint's file of fingerprint ``digest`` (by
        content, not name: a layout change renumbers files): returns each item's (offset,
        length) and the manifest's (crc32c, size) of it, or None (write it)."""
        if self._old is None or self.previous is None:
            return None
        found = self._by_fingerprint().get(digest)
        if found is None or len(found[1].get("items", ())) != count:
            return None
        old_name, old = found
        source = self.previous / old_name
        entry = (self._old_manifest or {}).get(old_name, {})
        try:
            size = os.stat(source, follow_symlinks=False).st_size
            if size != old.get("size") or size != entry.get("size"):
                self._fallback(f"{source}: size {size} differs from its records: written")
                return None
            # Read and checked before it is linked (a read, no write): its checksum goes into
            # this checkpoint's manifest, and the worker's prune trusts this checkpoint as
            # checksummed from the bytes. A file that rotted since is written anew.
            problem = entry_problem(old_name, entry, size, _crc_of(source))
            if problem is not None:
                log.warning("differential save: %s: %s; written anew", source, problem)
                self._fallback(f"{source}: {problem}: written")
                return None
            link_file(source, self.location / name)
        except OSError as e:  # pruned meanwhile, another filesystem: written instead
            self._fallback(f"{source}: not linked ({e}): written")
            return None
        items = [(int(o), int(n)) for o, n in old["items"]]
        crc = entry.get("crc32c")
        self.note(name, digest, size, items, linked=True)
        return items, (int(crc), size) if crc is not None else None

    def _by_fingerprint(self) -> dict[str, tuple[str, dict[str, Any]]]:
        with self._lock:
            if self._index is None:
                files = (self._old or {}).get("files", {})
                self._index = {e.get("fingerprint"): (n, e) for n, e in sorted(files.items())}
            return self._index

    def note(
        self, name: str, digest: str, size: int, items: list[tuple[int, int]], *, linked: bool
    ) -> None:
        with self._lock:
            self.files[name] = {
                "fingerprint": digest,
                "size": size,
                "items": [list(i) for i in items],
                "linked": linked,
            }

    def finish(self) -> Path:
        """Write the sidecar (the manifest checksums it with the rest); returns its path."""
        path = self.location / (self.prefix + SIDECAR)
        body = {
            "version": SIDECAR_VERSION,
            "fingerprint_seconds": self.fingerprint_seconds,
            "fingerprint_reused_bytes": self.reused_bytes,
            "files": self.files,
            "fallbacks": self.fallbacks,
        }
        write_synced(path, json.dumps(body, sort_keys=True).encode())
        for why in self.fallbacks:
            log.info("differential save: %s", why)
        return path


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else None
    except (OSError, ValueError):
        return None


def _crc_of(path: Path) -> Any:
    return lambda algorithm: checksum_file(path, algorithm=algorithm)[0]


def _checkpoint_root(part: Path) -> Path | None:
    """The checkpoint directory (it has the manifest) holding the part ``part``."""
    for d in (part, *part.parents):
        if (d / MANIFEST).is_file():
            return d
    return None


@dataclass(frozen=True)
class Figures:
    """What a save's sidecars say, summed over ranks and parts (``SaveStats``)."""

    bytes_skipped: int = 0
    bytes_written: int = 0
    files_linked: int = 0
    fingerprint_seconds: float = 0.0
    link_fallbacks: int = 0  # links tried and not made (each also an INFO line)
    fingerprint_reused_bytes: int = 0  # digests taken from the trainer, not computed


def figures(directory: Path) -> Figures:
    """Sum every sidecar under a checkpoint's directory (rank 0 at the commit)."""
    skipped = written = linked = fallbacks = reused = 0
    seconds = 0.0
    for path in sorted(Path(directory).rglob("*" + SIDECAR)):
        body = _read_json(path) or {}
        seconds = max(seconds, float(body.get("fingerprint_seconds", 0.0)))
        fallbacks += len(body.get("fallbacks", ()))
        reused += int(body.get("fingerprint_reused_bytes", 0))
        for entry in body.get("files", {}).values():
            if entry.get("linked"):
                skipped += int(entry.get("size", 0))
                linked += 1
            else:
                written += int(entry.get("size", 0))
    return Figures(skipped, written, linked, seconds, fallbacks, reused)


def _links(fmt: str, extra: Any) -> bool:
    """Whether the format writes differential saves (a format carried by the job included)."""
    try:
        return format_of(fmt, extra).differential
    except (KeyError, ValueError):
        return True  # components: each part's format decides for itself


def save_figures(directory: Path) -> dict[str, Any]:
    """``SaveStats``' differential figures of the save in ``directory``."""
    return dict(as_stats(figures(directory)))


def as_stats(f: Figures) -> Mapping[str, Any]:
    return {
        "bytes_skipped": f.bytes_skipped,
        "bytes_written": f.bytes_written,
        "files_linked": f.files_linked,
        "fingerprint_seconds": f.fingerprint_seconds,
        "link_fallbacks": f.link_fallbacks,
        "fingerprint_reused_bytes": f.fingerprint_reused_bytes,
    }


def known_digests(
    views: Mapping[str, Any], digests: Mapping[str, bytes] | None
) -> dict[tuple[int, int], bytes]:
    """The trainer's digests (``SaveJob.digests``: staged key -> digest) by where the worker's
    view of each key lies: (address, nbytes) names the bytes themselves, so a write item that
    is a view's whole bytes (and nothing else) finds its digest, whatever its DCP key."""
    out: dict[tuple[int, int], bytes] = {}
    for key, digest in (digests or {}).items():
        view = views.get(key)
        if view is not None and view.nbytes > 0:
            out[(view.data_ptr(), view.nbytes)] = digest
    return out


#: A file's identity on its filesystem, (st_dev, st_ino): names with one identity are one file,
#: and damage to its bytes is damage to every checkpoint holding one of the names.
FileId = tuple[int, int]
T = TypeVar("T")


def link_source(
    candidates: Sequence[int],
    kept: Collection[int],
    files: Callable[[int], AbstractSet[T] | None],
) -> int | None:
    """The step a save links its unchanged files from, or None: it writes every file.

    ``candidates``: committed steps, in the order preferred; ``kept``: the committed steps the
    prune after this save keeps beside the new one; ``files(step)``: the identities of that
    step's files a link could share (None: unknown, the step went meanwhile: neither a source
    nor a guard).

    The new checkpoint holds files of its own and links to the source's, so linking from ``d``
    is allowed only where some kept step shares no file with ``d``: that step then shares none
    with the new one either, and one damaged file leaves one of the two whole. With nothing
    kept beside the new step (``KeepLast(1)``) there is nothing to guard: the first candidate.
    """
    if not kept:
        return next(iter(candidates), None)
    for d in candidates:
        mine = files(d)
        if mine is None:
            continue
        for k in kept:
            theirs = files(k) if k != d else None
            if theirs is not None and mine.isdisjoint(theirs):
                return d
    return None


#: Policies that decide from steps alone: predicting them reads no manifest.
_STEP_POLICIES = (KeepLast, KeepEvery, KeepSteps, KeepAll)


def _leaves(policy: RetentionPolicy) -> list[RetentionPolicy]:
    if isinstance(policy, Union):
        return [leaf for p in policy.policies for leaf in _leaves(p)]
    return [policy]


@dataclass(frozen=True)
class KeepRule:
    """What the prune after each commit keeps on this root: the engine's ``keep=`` (None:
    nothing is pruned), ``Retention(scope=)`` and its run. The worker chooses the checkpoint a
    save links from against it (``link_source``), on every rank (only one rank prunes)."""

    policy: RetentionPolicy | None = None
    scope: str = "all"
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.scope not in SCOPES or (self.scope == "run" and self.run_id is None):
            raise ValueError(f"scope {self.scope!r} (run_id {self.run_id!r}): not a prune's")

    def kept_beside(self, checkpoints: Sequence[CheckpointInfo], new: CheckpointInfo) -> set[int]:
        """The steps of ``checkpoints`` the prune that follows ``new``'s commit keeps, ``new``
        aside: ``retention.plan_prune`` as the worker's prune calls it, less what only ever
        keeps more (the tracker, which names the newest or the new step; pins; the step the run
        resumed from; a kept step that verifies). Never fewer than the prune keeps."""
        others = [c for c in checkpoints if c.step != new.step]
        plan = plan_prune(
            [*others, new],
            self.policy,
            run_id=self.run_id,
            scope=self.scope,
            committed_step=new.step,
        )
        return set(plan.keep) - {new.step}

    def reads_steps_only(self) -> bool:
        """Whether the policy keeps by steps alone (no manifest is read to predict it)."""
        if self.scope != "all":
            return False  # another run's steps are kept: its manifests say whose
        if self.policy is None:
            return True
        return all(type(p) in _STEP_POLICIES for p in _leaves(self.policy))


def about_new(
    step: int,
    metrics: Mapping[str, float],
    run_id: str | None,
    metadata: Mapping[str, Any],
    tier: str,
) -> CheckpointInfo:
    """The step being written, as its manifest will describe it to the prune."""
    return CheckpointInfo.from_manifest(
        {
            "step": step,
            "committed_at": time.time(),
            "metrics": dict(metrics),
            "run_id": run_id,
            "metadata": dict(metadata),
            "tier": tier,
        }
    )


class LinkSource:
    """The worker's choice of what the next save may link from: among the committed
    checkpoints, the last one it committed first (at its first save the one the tracker
    names), then the newest, the first that ``link_source`` allows against what the prune
    after that save keeps (``keep``). ``rank``: whose files (DCP's ``__<rank>_`` names) this
    worker links, the only ones whose identities it compares."""

    def __init__(
        self,
        root: Path,
        layout: str,
        enabled: bool,
        keep: KeepRule | None = None,
        rank: int = 0,
    ) -> None:
        self.root = root
        self.layout = layout
        self.enabled = enabled
        self.keep = keep if keep is not None else KeepRule()
        self.prefix = f"__{rank}_"
        self.last: Path | None = None
        self._said: set[str] = set()
        # A committed directory never changes: what was read of it, by (name, its inode).
        self._files: dict[tuple[str, int], frozenset[FileId]] = {}
        self._infos: dict[tuple[str, int], CheckpointInfo] = {}

    def previous(
        self,
        tmp: Path,
        fmt: str,
        extra: Any,
        known: Mapping[tuple[int, int], bytes] | None = None,
        *,
        new: CheckpointInfo,
    ) -> Previous | None:
        """For the save of ``new`` (``about_new``) being written into ``tmp``: None with
        differential off (or a format that does not link: said once in the log). ``extra``:
        the job's (a carried format); ``known``: the trainer's digests of staged views
        (``known_digests``)."""
        if not self.enabled:
            return None
        if not _links(fmt, extra):
            if fmt not in self._said:
                self._said.add(fmt)
                log.info(
                    "differential saves are off for format %r: every file is written "
                    "(linking is built for plain DCP parts only)",
                    fmt,
                )
            return None
        return Previous(self._source(new), tmp, known or {})

    def _source(self, new: CheckpointInfo) -> Path | None:
        committed = {c.step: c.path for c in scan(self.root, self.layout)}
        if self.last is None:
            step = read_tracker(self.root)
            if step is not None:
                self.last = self.root / dir_name(self.layout, step)
        first = [s for s, p in committed.items() if p == self.last]
        candidates = first + sorted((s for s in committed if s not in first), reverse=True)
        if not candidates:
            return None
        live = {self._key(p) for p in committed.values()}  # forget what was pruned
        self._files = {k: v for k, v in self._files.items() if k in live}
        self._infos = {k: v for k, v in self._infos.items() if k in live}
        kept = self.keep.kept_beside(self._describe(committed), new)
        chosen = link_source(candidates, kept, lambda s: self._identities(committed[s]))
        if chosen != candidates[0]:
            how = "writes every file" if chosen is None else f"links from step {chosen}"
            log.info(
                "differential save of step %d %s, not from step %d: one of the steps kept "
                "beside it (%s) must share no file with it, so that one damaged file never "
                "takes every kept step",
                new.step,
                how,
                candidates[0],
                ", ".join(map(str, sorted(kept))),
            )
        return committed[chosen] if chosen is not None else None

    @staticmethod
    def _key(path: Path) -> tuple[str, int]:
        try:
            return (path.name, os.stat(path, follow_symlinks=False).st_ino)
        except OSError:
            return (path.name, -1)

    def _describe(self, committed: Mapping[int, Path]) -> list[CheckpointInfo]:
        """What the prune's policy looks at, of each committed step (a step gone: left out)."""
        if self.keep.reads_steps_only():
            return [CheckpointInfo(step, 0.0, path=path) for step, path in committed.items()]
        out = []
        for step, path in committed.items():
            key = self._key(path)
            if key not in self._infos:
                try:
                    self._infos[key] = read_checkpoint_info(path, step)
                except OSError:
                    continue
            out.append(self._infos[key])
        return out

    def _identities(self, path: Path) -> frozenset[FileId] | None:
        """The identities of this rank's files under the committed ``path`` (None: gone)."""
        key = self._key(path)
        if key[1] < 0:
            return None
        if key not in self._files:
            found: set[FileId] = set()

            def fail(e: OSError) -> None:
                raise e

            try:
                for where, _, names in os.walk(path, onerror=fail):
                    for name in names:
                        if name.startswith(self.prefix):
                            st = os.lstat(os.path.join(where, name))
                            if stat.S_ISREG(st.st_mode):
                                found.add((st.st_dev, st.st_ino))
            except OSError:
                return None
            self._files[key] = frozenset(found)
        return self._files[key]

    def committed(self, final: Path) -> None:
        self.last = final
