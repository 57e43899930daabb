"""Restoring: find the newest good checkpoint, check the target against it, then read.

``Restorer`` is the engine's reading side, apart from its saving side: it knows the root, its
layout and format(s), and (with a remote tier) the object store; it never talks to the worker.
Every load checks the whole target against the checkpoint's metadata before it reads anything
(invariant 11), verifies the manifest's checksums (invariant 5) and falls back to an older
checkpoint, loudly, when one is unusable.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from asyncckpt._torch import or_dcp_error
from asyncckpt.core import layout as _layout
from asyncckpt.errors import (
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    NotACheckpointRoot,
    NoValidCheckpoint,
    StateMismatch,
    UncommittedResume,
)
from asyncckpt.formats import dcp, loadcheck, records, staged
from asyncckpt.formats.base import Verify
from asyncckpt.formats.components import COMPONENTS, Component, Part, load_parts, saved_spec
from asyncckpt.formats.hotread import HotDeclined, HotRead, active
from asyncckpt.formats.loadcheck import LoadReport, Vanished, restrict, without
from asyncckpt.formats.precheck import Pending, check_files, gating
from asyncckpt.memory.hot_resume import HotResume
from asyncckpt.retention import CheckpointInfo
from asyncckpt.storage import RemoteTier
from asyncckpt.storage.commit import (
    advance_tracker,
    new_token,
    remove_tracker,
    remove_tree,
    rename_into_place,
)
from asyncckpt.storage.fresh_start import check_not_lost
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.manifest import check_dir, read_manifest
from asyncckpt.storage.prune import (
    list_checkpoints,
    list_quarantined,
    quarantine,
    trash_and_delete,
)
from asyncckpt.trainer.earlier_worker import OrphanWaits
from asyncckpt.trainer.local_load import Agreed, StepAgreement

_deferred = threading.local()


def _warn(msg: str, stacklevel: int) -> None:
    """``warnings.warn``; in a load the async facade runs in a thread (``deferring_warnings``),
    kept for it to re-emit at the caller's line: a thread's stack never reaches it."""
    pending = getattr(_deferred, "warnings", None)
    if pending is not None:
        pending.append(msg)
    else:
        warnings.warn(msg, stacklevel=stacklevel + 1)


def deferring_warnings(fn: Callable[[], Any], into: list[str]) -> Callable[[], Any]:
    """``fn`` with the warnings of this module appended to ``into`` instead of emitted."""

    def run() -> Any:
        _deferred.warnings = into
        try:
            return fn()
        finally:
            _deferred.warnings = None

    return run


log = logging.getLogger("asyncckpt")


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be a non-negative int, not {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"step must be a non-negative int, got {step}")
    return step


class _Damaged(CorruptCheckpoint):
    """The checkpoint fails its own manifest (a checksum, a size, a missing file, the manifest
    unreadable): damage for certain, which quarantines it. Other ``CorruptCheckpoint``s (data
    that verified but could not be read, an I/O error) may be the target's or the machine's
    fault, and leave the checkpoint where it is."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _timed(
    load: Callable[Concatenate[Restorer, _P], _R],
) -> Callable[Concatenate[Restorer, _P], _R]:
    """Add the load's wall time to ``Restorer.load_seconds`` (the goodput ledger's)."""

    @functools.wraps(load)
    def timed(self: Restorer, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        t0 = time.monotonic()
        try:
            return load(self, *args, **kwargs)
        finally:
            self.load_seconds += time.monotonic() - t0

    return timed


def _kept_while_read(load_dir: Callable[..., LoadReport]) -> Callable[..., LoadReport]:
    """``load_dir`` with no prune of the running worker deleting that step meanwhile."""

    @functools.wraps(load_dir)
    def reading(self: Restorer, state: Any, directory: Path, strict: bool = True,
                step: int | None = None, *args: Any, **kwargs: Any) -> LoadReport:  # fmt: skip
        if step is None or directory.parent != self.root:
            return load_dir(self, state, directory, strict, step, *args, **kwargs)
        with self.kept_while_read(step):
            return load_dir(self, state, directory, strict, step, *args, **kwargs)

    return reading


class Restorer:
    """Loads into a target from one root (and its remote tier).

    ``quarantine``: this rank is the one that moves a checkpoint found corrupt into
    ``<root>/.quarantine/`` (the rank that prunes: one per shared root); the others only skip
    it. Steps found corrupt are remembered in ``known_corrupt`` either way.
    """

    def __init__(
        self,
        root: Path,
        layout: str,
        fmt: str,
        components: dict[str, Component] | None,
        *,
        verify_on_load: bool,
        legacy: Any,
        rank: int,
        world_size: int,
        remote: RemoteTier | None,
        on_loaded: Callable[[int], None],
        quarantine: bool = True,
    ) -> None:
        self.root = root
        self.layout = layout
        self.fmt = fmt
        self.components = components
        self.verify_on_load = verify_on_load
        self.legacy = legacy
        self.rank = rank
        self.world_size = world_size
        self.remote = remote
        self.on_loaded = on_loaded  # the step a load restored (the engine's resumed-from)
        self.last_load_report: LoadReport | None = None
        self.load_seconds = 0.0  # every load's wall time (trainer/ledger.py)
        self.quarantine = quarantine
        # Steps this engine found failing their manifest: they stop counting (the forward
        # check of steps ignores them) also where they could not be moved aside.
        self.known_corrupt: set[int] = set()
        # A hot resume: load_latest from a surviving worker's memory (hot_resume.py).
        # Where loads wait for the workers earlier trainers left (earlier_worker.py).
        self.orphans = OrphanWaits(root, lambda: self.root_locked)
        self.hot = HotResume(root, rank, world_size, wait_for_worker=self.orphans.for_worker)
        self.agreement: StepAgreement | None = None  # node-local roots, set at start
        self.agreed: Agreed | None = None  # its outcome for the load in progress
        self.root_locked = False  # the engine started: lock_root waited for an orphan
        # The running worker prunes nothing a load reads (engine: pins.kept_while_read).
        self.kept_while_read: Callable[[int], Any] = lambda step: contextlib.nullcontext()

    def committed(self) -> list[_layout.CommittedDir]:
        return _layout.scan(self.root, self.layout)

    @_kept_while_read
    def load_dir(
        self,
        state: Any,
        directory: Path,
        strict: bool = True,
        step: int | None = None,
        hot: HotRead | None = None,
        given_manifest: dict[str, Any] | None = None,
    ) -> LoadReport:
        """Restore one checkpoint directory into ``state``: check, verify, then read.

        The target is compared with the checkpoint's metadata before anything is read into
        it (``StateMismatch``: nothing changed). Unreadable data is a ``CorruptCheckpoint``, a
        directory that went away while read (pruned) a ``loadcheck.Vanished``; torch's own
        errors (DCP's ``CheckpointException`` is a BaseException) are chained as the cause.
        A checkpoint of components is read as one part per component the target names, all
        checked before any is read. ``hot``: tensor bytes from memory (``HotDeclined``);
        ``given_manifest``: the checksums to check against, for a step not committed yet
        (hot_resume.py ``load_committing``: the worker committing it offered them).
        """
        manifest: dict[str, Any] | None = None
        files: dict[str, Any] = {}
        if given_manifest is not None:
            manifest = given_manifest
            files = dict(manifest.get("files", {}))
        elif (directory / _layout.MANIFEST).exists():
            try:
                manifest = read_manifest(directory)
            except CorruptCheckpoint as e:
                if not directory.is_dir():
                    raise loadcheck.Vanished(f"{directory} went away before it was read") from None
                raise _Damaged(str(e), [str(e)]) from None
            if self.verify_on_load:
                files = dict(manifest.get("files", {}))
        elif not directory.is_dir():
            raise loadcheck.Vanished(f"{directory} went away before it was read")
        elif self.verify_on_load:
            _warn(f"{directory} has no manifest; loading without checksums", stacklevel=3)
        parts = self._parts(state, directory, manifest, step)
        nbytes = sum(int(f.get("size", 0)) for f in files.values())
        with loadcheck.Progress(directory, nbytes) as progress:
            # The metadata the check trusts is verified first (all of a legacy or pt file: the
            # check reads it); the bulk of the data after the check, so a mismatch fails fast.
            first = {r for r in files if loadcheck.read_by_check(r, parts, directory)}
            self._verify(directory, {r: files[r] for r in first}, progress)
            reports = [
                loadcheck.check(
                    p.fmt,
                    p.state,
                    p.location,
                    strict=strict,
                    legacy=self.legacy,
                    weights_only=p.weights_only,
                    world_size=self.world_size,
                )  # fmt: skip
                for p in parts
            ]
            # Every file is checked before a byte goes into the target (invariant 11: a load
            # restores the whole target or changes nothing). A reader can check files as it
            # reads them (``LoadOptions.verify``), but tensors it reads in place would then
            # hold a damaged checkpoint's bytes when nothing older loads (``load(step=)``):
            # one pass needs checksums per part, checked before the part is applied.
            rest = {r: f for r, f in files.items() if r not in first}
            # Hot: the data is checked as the memory is read, before any of it goes in.
            verify = _hot_verify(hot, parts, manifest, self.verify_on_load, rest)
            pending = None
            if verify is None and _checks_before_target(parts):
                # DCP's reader waits for the check before it writes a target: the check reads
                # the disk while the reader plans and locates its records.
                pending = Pending(lambda: self._verify(directory, rest, progress))
            elif verify is None:
                self._verify(directory, rest, progress)
            progress.reading()
            with records.count_fallbacks() as fallbacks, _hot_reading(hot), gating(pending):
                for part, report in zip(parts, reports, strict=True):
                    self._read_part(part, report, directory, verify)
        merged = loadcheck.merge_reports(parts, reports, strict)
        merged.records_fallbacks = fallbacks.total()
        return merged

    def _parts(
        self, state: Any, directory: Path, manifest: dict[str, Any] | None, step: int | None
    ) -> list[Part]:
        """What to read: one part (the whole state), or one per component the target names."""
        fmt = (manifest or {}).get("format") or self.fmt  # the format it was written in
        if self.components is not None or fmt == COMPONENTS:
            if self.components is None:
                raise StateMismatch(
                    f"{directory} is a checkpoint of components "
                    f"({list(saved_spec(manifest, {}))}); load it with an engine made with "
                    "the same components= (nothing was loaded)"
                )
            if fmt != COMPONENTS:
                raise StateMismatch(
                    f"{directory} was written in format {fmt!r}, not as components; load it "
                    "with an engine of that format (nothing was loaded)"
                )
            return load_parts(
                self.components, manifest, state, directory, step,
                rank=self.rank, world_size=self.world_size,
            )  # fmt: skip
        paths = (manifest or {}).get("paths")
        return [Part(None, fmt, state, directory, paths)]

    def _read_part(self, part: Part, report: LoadReport, directory: Path, verify: Any) -> None:
        try:
            # strict=False and something to skip, or other ranks' keys: read only the target's
            if report.missing or report.unexpected or report.other_ranks:
                self._load_partial(part, report, verify)
            else:
                # Any world size: each rank reads what its state asks for (DCP reshards).
                staged.load_into(
                    part.fmt, part.state, part.location, part.paths, legacy=self.legacy,
                    weights_only=part.weights_only, verify=verify,
                )  # fmt: skip
        except or_dcp_error(Exception) as e:  # noqa: BLE001 - re-raised, as ours
            if isinstance(e, (CheckpointError, HotDeclined)):
                raise
            if not directory.is_dir():
                raise loadcheck.Vanished(f"{directory} went away while it was read") from e
            raise loadcheck.read_error(directory, e) from e

    def _verify(self, directory: Path, files: dict[str, Any], progress: Any) -> None:
        """``files`` (a part of the manifest) checked against it before the read: every file
        at once, by several threads, without a copy (``precheck.check_files``)."""
        found = check_files(directory, files, on_bytes=progress.verified)
        damage, unreadable = found.damage, found.unreadable
        if damage or unreadable:
            if not directory.is_dir():
                raise Vanished(f"{directory} went away while it was verified")
            message = f"{directory}: " + "; ".join(damage + unreadable)
            # An I/O error alone may pass (a flaky mount): only a mismatch is damage.
            raise _Damaged(message, damage) if damage else CorruptCheckpoint(message)

    def _load_partial(self, part: Part, report: LoadReport, verify: Verify | None = None) -> None:
        """strict=False: read into a copy of the target's containers without the missing keys,
        then hand each part back cut to the target's keys (missing ones keep their value,
        unexpected ones are dropped), so a module's ``load_state_dict`` gets exactly its keys."""
        like = staged.materialize(part.state)
        sub = without(like, set(report.missing))
        staged.load_into(
            part.fmt, sub, part.location, part.paths, legacy=self.legacy,
            weights_only=part.weights_only, verify=verify, target_only=True,
        )  # fmt: skip
        dcp.merge_into(part.state, restrict(sub, like))

    def _check_other_layout(self) -> None:
        """No checkpoint of our layout: refuse a root that holds the other layout's."""
        for other in _layout.LAYOUTS:
            found = _layout.scan(self.root, other) if other != self.layout else []
            if found:
                names = ", ".join(c.path.name for c in found[-3:])
                raise NotACheckpointRoot(
                    f"{self.root} holds {other}-layout checkpoints ({names}) but this engine's "
                    f"layout is {self.layout!r}; pass layout={other!r}"
                )

    def _loaded(self, report: LoadReport, step: int | None, directory: Path) -> None:
        report.step, report.path = step, directory
        agreed, self.agreed = self.agreed, None
        if agreed is not None and agreed.choice.step == step and report.source == "disk":
            # Node-local roots: where this rank's bytes came from (its disk or its node's
            # replica fetched at this load) and why this step (local_load.py).
            report.source, report.source_reason = agreed.source, agreed.reason
        self.last_load_report = report
        if step is not None:
            self.on_loaded(step)
        _log_skipped(report, directory)

    @_timed
    def load_latest(self, state: Any, strict: bool = True) -> int | None:
        # (Before the start, the hot session waits for this rank's earlier worker to offer or
        # end, hot._connect; with no offer, or by step or path, _settle_orphans waits for every
        # one still committing, or ranks of a run that changed size resume different steps.)
        with self.hot.session(
            self.orphans.at_work()
        ):  # a surviving worker's offer, asked for and let go
            return self._load_latest(state, strict)

    def _load_latest(self, state: Any, strict: bool) -> int | None:
        if self.hot.source is None:
            self.orphans.settle()
        only = self._agreed_step()  # first: every rank publishes its steps, an empty root too
        remote = self._remote_only() if self.remote is not None else {}
        if not remote and not _check_root(self.root, self.layout, _also_in(self.remote)):
            return None
        # A step a surviving worker offers while committing it: from memory now (hot_resume.py).
        # Never on node-local roots (``only``): the step every rank loads is agreed, and a
        # step offered before its write is newer than any agreed (workers there offer none).
        taken = (
            None
            if only is not None
            else self.hot.before_commit(self.load_dir, state, strict, self.committed)
        )
        # Taken before it was written: it stands once committed as loaded (else the disk).
        if taken is not None and self.orphans.taken_stands(self.hot, self.layout, taken[1]):
            self._loaded(taken[1], taken[0], self.root / _layout.dir_name(self.layout, taken[0]))
            return taken[0]
        errors: list[str] = []
        tried: set[Path] = set()
        # A checkpoint pruned under our feet (another process's engine) is skipped quietly;
        # if every one we saw went, newer ones committed meanwhile: look again, a few times.
        for _ in range(3):
            local = {c.step: c for c in self.committed()}
            candidates = [
                local.get(step) or _layout.CommittedDir(step, self.root / remote[step])
                for step in sorted(set(local) | set(remote), reverse=True)
            ]
            candidates = [c for c in candidates if c.path not in tried]
            if only is not None:  # node-local roots: the step every rank loads, no other
                candidates = [c for c in candidates if c.step == only]
            if not tried and not candidates:
                self._check_other_layout()
            vanished = False
            for c in candidates:
                tried.add(c.path)
                try:
                    if c.step not in local:  # newest in the store only: fetch it here first
                        self._fetch(remote[c.step], c.path)
                    report = self.hot.load(self.load_dir, state, c.step, c.path, strict)
                except StateMismatch:
                    raise  # the caller's mistake: an older checkpoint would not fit either
                # DCP's CheckpointException derives from BaseException, not Exception.
                except or_dcp_error(Exception) as e:  # noqa: BLE001 - fall back
                    if isinstance(e, Vanished) or not c.path.is_dir():
                        log.debug("checkpoint step %d at %s was pruned while read", c.step, c.path)
                        vanished = True
                        continue
                    errors.append(f"step {c.step}: {e}")
                    aside = self._set_aside(c.step, c.path, e, fetched=c.step not in local)
                    msg = (
                        f"checkpoint step {c.step} at {c.path} is unusable ({e}); "
                        f"{aside}trying an older one"
                    )
                    _warn(msg, stacklevel=3)  # one channel: the caller's warning
                    continue
                self._loaded(report, c.step, c.path)
                return c.step
            if not vanished or errors:
                break
        if self.hot.spoiled:  # part of a memory that failed its checks went into the target
            errors.append(f"the memory offered: {self.hot.reason}")
        elif not remote:  # nothing committed left but quarantined ones: raise, never None
            check_not_lost(self.root, self.layout, errors)
        if not errors:
            if remote or not list_quarantined(self.root, self.layout):  # (else said: start_fresh)
                log.warning(_FRESH, self.root.absolute(), _also_in(self.remote), "")
            return None
        if self.hot.uncommitted:  # the target holds a step on no disk, and none restores it
            raise UncommittedResume(
                f"{self.hot.uncommitted}; nothing on disk restores the target: " + "; ".join(errors)
            )
        raise NoValidCheckpoint(
            f"no committed checkpoint in {self.root} could be loaded: " + "; ".join(errors)
        )

    def _agreed_step(self) -> int | None:
        """Node-local roots of several nodes (``agreement`` set at start): the step every
        rank loads, or None (no agreement to follow). Refused where no step can be had by
        every rank though some rank has one: some starting fresh while others resume."""
        if self.agreement is None:
            return None
        agreed = self.agreement.choose(c.step for c in self.committed())
        choice = agreed.choice
        if choice.step is None and choice.fell_back:
            raise NoValidCheckpoint(f"{self.root}: not loading: {choice.reason}")
        if choice.fell_back:
            _warn(choice.reason, stacklevel=4)
        self.agreed = agreed  # said in the load report (_loaded)
        return choice.step

    def _damage(self, directory: Path, e: BaseException) -> list[str] | None:
        """The problems that make ``directory`` damaged for certain, or None.

        A failure other than a manifest mismatch (data that verified and still could not be
        read, an I/O error, a target the reader refused) is not damage; with
        ``verify_on_load=False`` the manifest is checked now to tell. A checkpoint without a
        manifest (plain DCP, Megatron) cannot be told apart from a bad target: never."""
        if isinstance(e, _Damaged):
            return e.problems or None
        if self.verify_on_load or not (directory / _layout.MANIFEST).exists():
            return None
        try:
            return check_dir(directory) or None
        except OSError:
            return None

    def _set_aside(self, step: int, directory: Path, e: BaseException, *, fetched: bool) -> str:
        """A checkpoint of this root found damaged stops counting: moved into
        ``.quarantine/`` (by the quarantining rank; never deleted). Returns what was done,
        for the message ("" when it is not damage)."""
        problems = self._damage(directory, e)
        if problems is None:
            return ""
        self.known_corrupt.add(step)
        if not self.quarantine:
            return "another rank sets it aside; "
        try:
            if fetched:
                # Only a download of the store's copy, which stays where it is (an object
                # store has no rename to quarantine with): the local copy goes.
                trash_and_delete(self.root, directory)
                url = self._tier().url
                return (
                    f"its download from {url} was removed (the store's copy stays: "
                    f"`python -m asyncckpt verify {url}`); "
                )
            moved = quarantine(self.root, directory, problems)
        except FileNotFoundError:
            return ""  # pruned meanwhile
        except OSError as err:
            log.warning("could not move the corrupt checkpoint %s aside: %s", directory, err)
            return ""
        _tracker_past(self.root, self.layout, step)
        return f"moved to {moved} (no longer a checkpoint); "

    def _tier(self) -> RemoteTier:
        if self.remote is None:  # (only reached when the engine has an object store)
            raise CheckpointError(f"{self.root} has no object store to read from")
        return self.remote

    def _remote_only(self) -> dict[int, str]:
        """Steps committed in the store and not on disk (step -> name), read once per load."""
        store = self._tier().open()
        local = {c.step for c in self.committed()}
        return {c.step: c.name for c in store.committed(self.layout) if c.step not in local}

    def _fetch(self, name: str, final: Path) -> None:
        """Download a committed checkpoint of the store into the local root, as a commit there
        (temporary, then rename: a crash mid-download leaves only a leftover)."""
        LocalStore(self.root).create_root()
        step = _layout.parse_dir_name(self.layout, name)
        if step is None:
            raise CheckpointError(f"{name} is not a {self.layout} checkpoint name")
        tier = self._tier()
        tmp_dir = self.root / _layout.tmp_name(self.layout, step, new_token())
        log.info("fetching %s/%s into %s", tier.url, name, final)
        try:
            tier.open().fetch(name, tmp_dir)
            rename_into_place(tmp_dir, final)
        except BaseException:
            if tmp_dir.exists():
                remove_tree(tmp_dir)
            raise

    @_timed
    def load(
        self,
        state: Any,
        step: int | None = None,
        path: str | os.PathLike | None = None,
        strict: bool = True,
    ) -> int:
        if (step is None) == (path is None):
            raise ValueError("pass exactly one of step= or path=")
        self.orphans.settle()
        if path is not None:
            directory = Path(path)
            if not directory.is_dir():
                raise CheckpointNotFound(f"no checkpoint directory at {directory}")
            if _layout.is_leftover(directory.name):
                raise CorruptCheckpoint(
                    f"{directory} is an uncommitted temporary, not a checkpoint"
                )
            found = _layout.parse_dir_name(self.layout, directory.name)
        else:
            step = check_step(step)
            directory = self.root / _layout.dir_name(self.layout, step)
            if not directory.is_dir():
                raise CheckpointNotFound(f"step {step} is not committed in {self.root}")
            found = step
        try:
            report = self.load_dir(state, directory, strict, found)
        except (CheckpointNotFound, StateMismatch):
            raise
        except CheckpointError as e:
            # Pruned by another process at any moment of the load (before its manifest was
            # read, say): gone, not damaged.
            if not directory.is_dir():
                raise Vanished(f"{directory} went away while it was read") from e
            if isinstance(e, _Damaged):
                ours = directory.parent.resolve() == self.root.resolve()
                aside = ""
                if found is not None and ours:
                    aside = self._set_aside(found, directory, e, fetched=False)
                if aside:
                    raise CorruptCheckpoint(f"{e}; {aside.rstrip('; ')}") from e
            raise
        self._loaded(report, found, directory)
        return found if found is not None else -1

    def list_checkpoints(self) -> list[CheckpointInfo]:
        self.orphans.before_listing()
        return list_checkpoints(self.root, self.layout)


def _tracker_past(root: Path, layout: str, step: int) -> None:
    """The tracker named the step just quarantined: name the newest one left instead, or
    remove it when none is left (it must only ever name a committed checkpoint; Megatron's
    loaders read it)."""
    left = _layout.scan(root, layout)
    if _layout.read_tracker(root) != step:
        return
    try:
        if left:
            advance_tracker(root, layout, left[-1].step)
        else:  # none left: no tracker (Megatron's loaders then start fresh, as we do)
            remove_tracker(root, layout)
    except OSError as err:
        log.warning("could not update the tracker of %s: %s", root, err)


#: What load_latest logs when it finds nothing to load: a fresh run's first start, or a
#: mistyped root (the absolute path shows which).
_FRESH = "no checkpoint in %s%s%s: starting fresh (check the path if a checkpoint was expected)"


def _also_in(remote: RemoteTier | None) -> str:
    """Where else a checkpoint was looked for, for the line that says none was found."""
    return f" nor in {remote.url}" if remote is not None else ""


def _check_root(root: Path, layout: str, also_in: str = "") -> bool:
    """False when the root does not exist (a fresh run, or a mistyped root: said in one
    warning naming the absolute path); raise when it is not a root at all."""
    if not root.exists():
        log.warning(_FRESH, root.absolute(), also_in, " (the directory does not exist)")
        return False
    if not root.is_dir():
        raise NotACheckpointRoot(f"checkpoint root {root} is not a directory")
    looks_like_one = any(
        _layout.parse_dir_name(lay, root.name) is not None for lay in _layout.LAYOUTS
    )
    if (
        (root / _layout.DCP_METADATA).exists()
        or (root / _layout.MANIFEST).exists()
        # named like one, holding files but no checkpoint (a Megatron legacy dir, say)
        or (looks_like_one and any(root.iterdir()) and not _layout.scan(root, layout))
    ):
        raise NotACheckpointRoot(
            f"{root} is a checkpoint directory, not a checkpoint root; pass its parent "
            f"({root.parent}) as the root, or use load(state, path={str(root)!r})"
        )
    return True


def _log_skipped(report: LoadReport, directory: Path) -> None:
    """What a load left as it was (strict=False, objects the checkpoint does not have)."""
    if report.missing or report.unexpected:
        log.warning(
            "loaded %s with strict=False: kept the target's own %s (not in the checkpoint); "
            "did not load %s (not in the target)",
            directory,
            report.missing or "-",
            report.unexpected or "-",
        )
    if report.missing_objects:
        log.warning(
            "loaded %s: the checkpoint has no %s; the target keeps its own value(s)",
            directory,
            report.missing_objects,
        )


def _hot_verify(
    hot: HotRead | None, parts: list[Part], manifest: Any, verified: bool, files: dict
) -> Verify | None:
    """The files a hot read checks as it reads (None: not hot); ``HotDeclined`` unless it
    covers one DCP part checked against a manifest."""
    if hot is None:
        return None
    why = None
    if manifest is None or not verified:
        why = "no manifest to check the memory against (verify_on_load=False or none written)"
    elif len(parts) != 1 or parts[0].fmt != "dcp":
        why = f"format {parts[0].fmt if len(parts) == 1 else COMPONENTS!r} is read from disk only"
    if why is not None:
        hot.settle({"": why})
    return Verify(files)


def _checks_before_target(parts: list[Part]) -> bool:
    """Whether the reader of ``parts`` waits for the load's check before it writes a target
    (``precheck.before_target``): one part in DCP's format, read by formats/dcp.py's reader."""
    return len(parts) == 1 and parts[0].fmt == "dcp"


@contextlib.contextmanager
def _hot_reading(hot: HotRead | None) -> Iterator[None]:
    if hot is None:
        yield
        return
    with active(hot):
        yield
    if not hot.settled:  # the format read no file: nothing was checked against the memory
        hot.settle({"": "the reader did not read from memory"})
