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
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .layout import MANIFEST
from .manifest import checksum_file, entry_problem
from .storage.localfs import link_file, write_synced
from .walltime import OverlapClock

log = logging.getLogger("asyncckpt")

#: The sidecar's name after the rank's DCP file prefix (``__0_``).
SIDECAR = "fingerprints.json"
SIDECAR_VERSION = 1
#: Tensors at least this large get a file of their own, so that an unchanged one can be
#: linked whatever its neighbours do (a frozen base beside trained adapters).
OWN_FILE_BYTES = 1 << 20
#: Smaller items are packed, in key order, into files of about this size.
PACK_BYTES = 64 << 20


def fingerprint_bytes(data: Any) -> bytes:
    """xxh3-128 of a bytes-like object (released GIL: the files of a save hash in parallel)."""
    return xxhash.xxh3_128_digest(data)


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
    from .formats import format_of

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


class LinkSource:
    """The worker's memory of what the next save may link from: the last checkpoint it
    committed, or at its first save the one the tracker names (committed by definition)."""

    def __init__(self, root: Path, layout: str, enabled: bool) -> None:
        self.root = root
        self.layout = layout
        self.enabled = enabled
        self.last: Path | None = None
        self._said: set[str] = set()

    def previous(
        self,
        tmp: Path,
        fmt: str,
        extra: Any,
        known: Mapping[tuple[int, int], bytes] | None = None,
    ) -> Previous | None:
        """For the save being written into ``tmp``: None with differential off (or a format
        that does not link: said once in the log). ``extra``: the job's (a carried format);
        ``known``: the trainer's digests of staged views (``known_digests``)."""
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
        if self.last is None:
            from .layout import dir_name, read_tracker

            step = read_tracker(self.root)
            if step is not None:
                self.last = self.root / dir_name(self.layout, step)
        last = self.last
        return Previous(last if last is not None and last.is_dir() else None, tmp, known or {})

    def committed(self, final: Path) -> None:
        self.last = final
