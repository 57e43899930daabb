"""Before a load writes anything: does the target fit the checkpoint? (invariant 11)

Pure comparisons of the caller's state with what a checkpoint holds (DCP's ``.metadata``, or
the tensors of a Megatron legacy file: each format's ``Format.entries``), by DCP key. A shape or dtype that differs, a tensor the
checkpoint lacks or one the target does not declare is the caller's mistake, not damage:
``check`` raises ``StateMismatch`` naming every such key before a single byte of the target is
overwritten.

Rules (``strict`` as in ``Module.load_state_dict``):

- a tensor key in both with another shape or dtype: always an error;
- ``missing`` (tensor in the target, not in the checkpoint) and ``unexpected`` (tensor in the
  checkpoint, not in the target): errors with ``strict=True``; with ``strict=False`` they are
  skipped (the target keeps its value, the checkpoint's is not loaded) and reported;
- an empty container (or None) in the target accepts whatever the checkpoint holds under its
  key: a fresh optimizer has an empty ``state`` and must load a stepped optimizer's state;
  likewise a non-tensor entry in the checkpoint covers target tensors under its key (it
  replaces that whole container);
- non-tensor leaves are pragmatic: those only in the checkpoint are loaded (new fields of an
  older target), those only in the target are reported in ``missing_objects``, never an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncckpt.core.entries import Entries, Entry, has_sharded_base, self_overlapping, walk  # noqa: F401 - names of this module too
from asyncckpt.core.progress import BytesReadSince
from asyncckpt.core.tree import is_terminal
from asyncckpt.errors import CheckpointError, CheckpointNotFound, CorruptCheckpoint, StateMismatch
from asyncckpt.formats import get_format
from asyncckpt.formats.base import LegacyRanks, LoadOptions

#: How many keys of each kind a StateMismatch message names before "... and N more".
MAX_LISTED = 20


@dataclass
class LoadReport:
    """What a load did not restore one to one; ``engine.last_load_report`` after each load.

    ``missing``: tensor keys of the target that the checkpoint lacks (kept as they were);
    ``unexpected``: tensor keys of the checkpoint that the target lacks (not loaded);
    ``missing_objects``: non-tensor keys of the target that the checkpoint lacks (kept);
    ``other_ranks``: keys of a checkpoint several ranks share that this rank's target does not
    ask for (another rank's; not read here, and not a mismatch);
    ``records_fallbacks``: tensor records the fast reader left to ``torch.load`` (correct but
    slower: a torch whose archives it cannot place, or records of views written by another
    tool; ``asyncckpt.formats.records.fallbacks`` has the reasons);
    ``source``: ``"disk"``, or ``"memory"`` for a hot resume from the shared memory of a worker
    that outlived its trainer (``MemoryTier(hold_seconds=)``), or ``"replica"`` on node-local
    roots where this rank's node fetched the step from a peer's replica at this load;
    ``source_reason``: why a hot resume was not taken, when one was offered
    or could have been, or on node-local roots which step every rank loads and where from.
    """

    step: int | None = None
    path: Path | None = None
    strict: bool = True
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    missing_objects: list[str] = field(default_factory=list)
    other_ranks: list[str] = field(default_factory=list)
    records_fallbacks: int = 0
    source: str = "disk"
    source_reason: str = ""

    @property
    def exact(self) -> bool:
        """True when every key of the target was restored and nothing was left out."""
        return not (self.missing or self.unexpected or self.missing_objects)


def _under(key: str, prefixes: set[str]) -> bool:
    """True when ``key`` lies strictly inside one of ``prefixes`` (dotted DCP keys)."""
    if not prefixes:
        return False
    parts = key.split(".")
    return any(".".join(parts[:i]) in prefixes for i in range(1, len(parts)))


def _fmt_entry(e: Entry) -> str:
    if e is None:
        return "a non-tensor value"
    shape, dtype = e
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:MAX_LISTED])
    return shown + (f", ... and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else "")


def compare(
    target: Entries,
    ckpt: Entries,
    *,
    strict: bool = True,
    where: str = "the checkpoint",
    shared: bool = False,
) -> LoadReport:
    """Compare the target with a checkpoint; raise ``StateMismatch`` if it does not fit.

    ``shared``: one checkpoint of several ranks' states, this target one rank's: a key of the
    checkpoint this rank does not ask for is another rank's (experts each rank owns), not
    unexpected; a rank cannot see the other ranks' targets without a collective, so a key no
    rank asks for is not detected there. Missing and mismatched keys are checked as always."""
    report = LoadReport(strict=strict)
    ckpt_objects = {k for k, v in ckpt.leaves.items() if v is None}
    mismatched: list[str] = []
    overlapping: list[str] = []
    for key, want in target.leaves.items():
        if key in ckpt.leaves:
            found = ckpt.leaves[key]
            if want is not None and found != want:
                # A tensor against another shape/dtype, or against a non-tensor value.
                mismatched.append(
                    f"{key}: target {_fmt_entry(want)}, checkpoint {_fmt_entry(found)}"
                )
            elif key in target.overlapping:
                overlapping.append(key)  # the load would write into it
            continue
        if _under(key, ckpt_objects):
            continue  # the checkpoint replaces this whole container
        if want is not None:
            report.missing.append(key)
        elif ckpt.objects_known:
            report.missing_objects.append(key)
    for key, found in ckpt.leaves.items():
        if found is None or key in target.leaves:
            continue
        if key not in target.open and not _under(key, target.open):
            (report.other_ranks if shared else report.unexpected).append(key)
    problems = []
    if mismatched:
        problems.append(
            f"{len(mismatched)} tensor(s) differ: " + "; ".join(mismatched[:MAX_LISTED])
        )
        if len(mismatched) > MAX_LISTED:
            problems[-1] += f"; ... and {len(mismatched) - MAX_LISTED} more"
    if overlapping:
        problems.append(
            f"{len(overlapping)} target tensor(s) overlap themselves (several elements share "
            "one memory location, as after expand()) and cannot hold the checkpoint's "
            f"values: {_listing(overlapping)}; pass tensors of their own (e.g. .clone())"
        )
    if strict and report.missing:
        problems.append(f"missing from the checkpoint (in the target): {_listing(report.missing)}")
    if strict and report.unexpected:
        problems.append(
            f"unexpected in the checkpoint (not in the target): {_listing(report.unexpected)}"
        )
    if problems:
        hint = ""
        if not (mismatched or overlapping):
            hint = " (strict=False loads the matching keys and skips these)"
        raise StateMismatch(
            f"the load target does not fit {where}; nothing was loaded{hint}: "
            + " | ".join(problems)
        )
    return report


# ------------------------------------------------------------------ strict=False loading


def without(like: Any, drop: set[str]) -> Any:
    """A copy of the containers of ``like`` (a materialized state) without the leaves in
    ``drop``; leaves are shared, not copied (tensors are read into in place)."""

    def go(x: Any, fqn: str, top: bool) -> Any:
        if isinstance(x, Mapping):
            out = {}
            for k, v in x.items():
                key = str(k) if top else f"{fqn}.{k}"
                if key not in drop:
                    out[k] = go(v, key, False)
            return out
        if isinstance(x, list) and x and not is_terminal(x):
            return [go(v, str(i) if top else f"{fqn}.{i}", False) for i, v in enumerate(x)]
        return x

    return go(like, "", True)


def restrict(loaded: Any, like: Any) -> Any:
    """``loaded`` cut to the keys of ``like``: entries ``like`` lacks are dropped, entries
    ``loaded`` lacks are taken from ``like``; an empty container in ``like`` takes all."""
    if isinstance(like, Mapping) and like and isinstance(loaded, Mapping):
        return {k: restrict(loaded[k], v) if k in loaded else v for k, v in like.items()}
    if isinstance(like, list) and like and not is_terminal(like) and isinstance(loaded, list):
        return [restrict(loaded[i], v) if i < len(loaded) else v for i, v in enumerate(like)]
    return loaded


class Vanished(CheckpointNotFound):
    """The checkpoint directory went away while it was being read (pruned by its engine):
    ``load_latest`` skips it quietly and tries the next older one."""


def _format(fmt: str, directory: Path) -> Any:
    """The registered format ``fmt`` (a name from a manifest, or the engine's)."""
    try:
        return get_format(fmt)
    except ValueError as e:
        raise CheckpointError(
            f"{directory}: {e} (a format of one's own is registered with "
            "asyncckpt.formats.register_format before the load)"
        ) from None


def check(
    fmt: str,
    state: Any,
    directory: str | os.PathLike,
    *,
    strict: bool = True,
    legacy: Any = None,
    weights_only: bool = True,
    world_size: int = 1,
) -> LoadReport:
    """Compare ``state`` with the checkpoint in ``directory`` before anything is read into it
    (what it holds: format ``fmt``'s ``Format.entries``). With ``world_size`` > 1 a checkpoint
    all ranks share (DCP-based formats) is compared as ``compare(shared=True)``.

    For format ``pt`` (one ``torch.save`` file of a component) ``directory`` is that file,
    read memory-mapped with ``weights_only``.

    Raises ``StateMismatch`` (the target does not fit), ``CorruptCheckpoint`` (the checkpoint's
    metadata cannot be read) or ``Vanished``. A state holding megatron ShardedTensors is left
    to megatron's loader, which validates it itself.
    """
    directory = Path(directory)
    where = str(directory)
    fmt_ = _format(fmt, directory)
    try:
        options = LoadOptions(legacy=legacy or LegacyRanks(), weights_only=weights_only)
        ckpt = fmt_.entries(state, directory, options)
    except StateMismatch:
        raise
    except Exception as e:
        if not directory.exists():
            raise Vanished(f"{directory} went away while it was read") from e
        raise CorruptCheckpoint(f"{directory}: cannot read the checkpoint's metadata: {e}") from e
    if ckpt is None:
        return LoadReport(strict=strict)  # nothing to compare with; the read will say why
    shared = world_size > 1 and fmt_.shared_by_ranks  # not a rank's own file
    return compare(walk(state), ckpt, strict=strict, where=where, shared=shared)


def read_by_check(rel: str, parts: list[Any], directory: Path) -> bool:
    """True for a file of the checkpoint (path relative to ``directory``) that ``check``
    reads for one of ``parts`` (``Format.read_by_check``): verified before the check trusts
    it. DCP's and torch_dist's metadata files, and the whole of a legacy or pt part (the check
    reads those files themselves)."""
    path = directory / rel
    return any(_format(p.fmt, directory).read_by_check(path, p.location) for p in parts)


def merge_reports(parts: list[Any], reports: list[LoadReport], strict: bool) -> LoadReport:
    """One report for a load of several parts (components): keys named by part."""
    if len(reports) == 1 and parts[0].name is None:
        return reports[0]
    out = LoadReport(strict=strict)
    for part, r in zip(parts, reports, strict=True):
        out.missing += [part.key(k) for k in r.missing]
        out.unexpected += [part.key(k) for k in r.unexpected]
        out.missing_objects += [part.key(k) for k in r.missing_objects]
        out.other_ranks += [part.key(k) for k in r.other_ranks]
    return out


def _raised_in_load_state_dict(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "load_state_dict":
            return True
        tb = tb.tb_next
    return False


def read_error(directory: Path, e: BaseException) -> CheckpointError:
    """Our error for a failure while reading a checkpoint that passed the check.

    A ``load_state_dict`` that refuses what was read (an optimizer's param groups, say) is the
    caller's mismatch; anything else (DCP's ``CheckpointException``, a truncated zip, an
    unpickling or I/O error) means the data could not be read.
    """
    if _raised_in_load_state_dict(e):
        return StateMismatch(f"the load target does not fit {directory}: {type(e).__name__}: {e}")
    msg = str(e).strip()
    lines = [ln for ln in msg.splitlines() if ln.strip()]
    # DCP's message is a traceback per rank: its last line names the real error.
    first = (lines[-1] if "CheckpointException" in type(e).__name__ else lines[0]) if lines else ""
    return CorruptCheckpoint(
        f"{directory}: cannot read the checkpoint ({first or type(e).__name__})"
    )


#: Loads of checkpoints at least this large show a progress bar (on a terminal).
PROGRESS_MIN_BYTES = 1 << 30


class Progress:
    """A minimal rich progress bar for verifying and reading a large checkpoint.

    Shown only when stderr is a terminal and the checkpoint holds at least
    ``PROGRESS_MIN_BYTES``; otherwise every method does nothing.
    """

    def __init__(self, directory: Path, nbytes: int) -> None:
        self.directory = directory
        self.nbytes = nbytes
        self._bar: Any = None
        self._verify: Any = None
        self._read: Any = None

    def __enter__(self) -> Progress:
        import sys

        if self.nbytes >= PROGRESS_MIN_BYTES and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import (
                Progress as RichProgress,
            )

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TimeElapsedColumn(),
                transient=True,
            )
            self._bar.start()
            name = self.directory.name
            self._verify = self._bar.add_task(f"verify {name}", total=self.nbytes)
        return self

    def verified(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._verify, nbytes)

    def reading(self) -> None:
        if self._bar is not None:
            self._bar.update(self._verify, completed=self.nbytes)
            # The reader (DCP, formats/) reports no bytes: the total is the checkpoint's size,
            # and what this process has read since (/proc/self/io) moves the bar.
            self._read = self._bar.add_task(f"read {self.directory.name}", total=self.nbytes)
            self._reads = BytesReadSince(
                lambda n: self._bar.update(self._read, completed=min(n, self.nbytes))
            )

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._bar is not None:
            if getattr(self, "_reads", None) is not None:
                self._reads.stop()
                if exc_type is None:  # read whole
                    self._bar.update(self._read, completed=self.nbytes)
            self._bar.stop()
