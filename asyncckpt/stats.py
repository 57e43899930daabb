"""The figures every save reports, for users' own overhead dashboards.

``SaveStats`` is what ``handle.stats`` and ``on_commit`` get; every manifest records the same
figures, which ``read_stats`` / ``summarize`` / ``plot_stats`` read back (``python -m asyncckpt
stats ROOT``)."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncckpt.core import layout as _layout
from asyncckpt.core.paths import check_local_root
from asyncckpt.errors import CheckpointError
from asyncckpt.storage.goodput import Goodput, RunRecord
from asyncckpt.storage.manifest import read_manifest
from asyncckpt.storage.prune import detect_layout


@dataclass
class SaveStats:
    """The figures of one save: what ``handle.stats`` holds once it committed, what
    ``on_commit`` is called with, and what its manifest records (``read_stats`` reads them
    back). Times are seconds, sizes bytes; a figure of a feature the save did not use is 0
    (or None)."""

    step: int
    """The training step saved (the ``N`` of its directory's name, ``global_step_N``)."""
    stage_seconds: float = 0.0
    """Seconds ``save`` blocked copying the state into the staging buffers."""
    wait_seconds: float = 0.0
    """Seconds ``save`` waited for a free staging buffer (back-pressure; for a state staged
    in chunks, also for the worker to write a chunk and free its buffer)."""
    chunks: int = 0
    """Chunks the state was staged in: 0 where it fit ``Staging(max_host_bytes=)`` whole."""
    overlapped: bool = False
    """An overlapped save (``overlap=True``): ``stage_seconds`` ran behind the training
    loop."""
    staged_wait_seconds: float = 0.0
    """Overlapped saves: seconds the loop waited in ``handle.staged()`` or the optimizer
    hook."""
    alloc_seconds: float = 0.0
    """Seconds allocating the staging buffers (the first save of a state's layout; 0 once
    ``prepare`` ran)."""
    write_seconds: float = 0.0
    """Seconds the worker spent writing and fsyncing the shards."""
    commit_seconds: float = 0.0
    """Seconds for the manifest, the rename and the tracker file."""
    paused_seconds: float = 0.0
    """Seconds of ``write_seconds`` the worker held its writes for ``pause_writes``
    regions."""
    durable_seconds: float | None = None
    """Seconds from the ``save`` call to the commit (durable: renamed, fsynced, tracker
    written)."""
    throttled_seconds: float = 0.0
    """Wall time the worker held this save's writes: the rate cap and ``pause_writes``
    regions (in a multi-rank save, the committing worker's: rank 0's, or a node leader's)."""
    io_threads: int = 0
    """Shard files the worker wrote at once (``ThrottleConfig(io_threads=)``): what its
    writers ran, which may be fewer than set, or chosen under ``"auto"`` (fewer shard files,
    a one-file format); in a multi-rank save the committing worker's; 0 where none
    reported."""
    escalated_after_seconds: float | None = None
    """With ``durable_within``: seconds into the save at which the worker escalated (None:
    it did not need to)."""
    escalations: list[str] = field(default_factory=list)
    """With ``durable_within``: the levers the worker released when it escalated."""
    bytes: int = 0
    """Bytes written: all files of the checkpoint."""
    staged_bytes: int = 0
    """Bytes staged: the tensors' data."""
    committed_at: float | None = None
    """Unix time at which the checkpoint committed."""
    path: str | None = None
    """The committed checkpoint's directory."""
    saved_at: float | None = None
    """Unix time of the ``save`` call."""
    upload_seconds: float = 0.0
    """With a remote tier: seconds publishing the checkpoint to the object store."""
    uploaded_bytes: int = 0
    """With a remote tier: bytes sent to the object store."""
    remote_path: str | None = None
    """With a remote tier: where the checkpoint was published (its URL)."""
    export_seconds: float = 0.0
    """With an ``HFExport`` due at this step: seconds writing it."""
    export_path: str | None = None
    """With an ``HFExport`` due at this step: where it was written."""
    records_fallbacks: int = 0
    """Small tensors written one by one with ``torch.save`` because no faster layout could
    be proven for them on this torch (correct, slower; logged once); rank 0's own."""
    bytes_skipped: int = 0
    """Differential saves (``Staging(differential=True)``), over every rank of the step:
    shard bytes not written because their file is a hard link to the previous
    checkpoint's."""
    bytes_written: int = 0
    """Differential saves, over every rank of the step: shard bytes written (the files not
    linked)."""
    files_linked: int = 0
    """Differential saves, over every rank of the step: shard files hard-linked to the
    previous checkpoint's instead of written."""
    fingerprint_seconds: float = 0.0
    """Differential saves: seconds the worker spent fingerprinting the staged bytes (the
    slowest rank's)."""
    link_fallbacks: int = 0
    """Differential saves: links tried and not made, the file written instead (the previous
    checkpoint gone, its fingerprints failing their checksum, another filesystem), each with
    an INFO line from the worker."""
    fingerprint_reused_bytes: int = 0
    """Of the bytes the worker fingerprinted, those whose digest it took from the copy's own
    fingerprints (large CPU tensors, hashed once per save, not twice)."""
    copy_skipped_bytes: int = 0
    """Differential saves, the copy (this rank's, in ``save``'s own time): tensor bytes not
    copied into the staging buffer because it held them already (fingerprinted where they
    live)."""
    copy_fingerprint_seconds: float = 0.0
    """Differential saves: seconds of ``stage_seconds`` spent fingerprinting tensors to skip
    their copy."""
    copy_skip_fallbacks: int = 0
    """Differential saves: large tensors that could not be fingerprinted (strided), copied
    and never skipped."""
    copy_check_seconds: float = 0.0
    """Overlapped saves: seconds spent in the background comparing the CPU tensors' bytes
    with the staged ones after the copy (the check that no tensor changed while it was
    copied); saves staged in chunks: the compare of the sources with the staged bytes'
    fingerprints once the last chunk is copied (part of the stall)."""

    @property
    def blocked_seconds(self) -> float:
        """Total time ``save`` held the training loop (overlapped: waits for the copy)."""
        if self.overlapped:
            return self.wait_seconds + self.staged_wait_seconds
        return self.stage_seconds + self.wait_seconds + self.alloc_seconds

    @property
    def throughput_bytes_per_s(self) -> float:
        """``bytes`` over ``write_seconds``: the worker's write rate (0 where nothing was
        timed)."""
        return self.bytes / self.write_seconds if self.write_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["blocked_seconds"] = self.blocked_seconds
        d["throughput_bytes_per_s"] = self.throughput_bytes_per_s
        return d


@dataclass(frozen=True)
class EngineStats:
    """Figures of the engine as a whole, across saves (``engine.stats``, a snapshot)."""

    #: memory saves lost because the worker holding them died (the trainer alive): each one
    #: also logs a WARNING on the ``asyncckpt`` logger naming its step
    memory_saves_lost: int = 0
    #: the step of the memory save lost last, until the replacement worker holds a newer
    #: memory save (then None): meanwhile a trainer's death resumes from disk, not this step
    memory_unprotected_step: int | None = None
    #: disk saves staged into a memory-tier slot and written from it (no slot of their own:
    #: two copies of the state serve both tiers)
    disk_saves_shared: int = 0
    #: disk saves, the memory tier on, staged into a slot of their own all the same (overlapped,
    #: another layout, a step not after the last memory save): one more copy of the state;
    #: each reason is logged once at INFO
    disk_saves_unshared: int = 0
    #: the intervals in effect, in steps: disk saves (``should_save``/``due``) and memory saves
    #: (``due``); the user's, or those ``Schedule(mtbf=)`` chose (``intervals_measured``)
    disk_every_steps: int | None = None
    memory_every_steps: int | None = None
    intervals_measured: bool = False
    #: the goodput ledger (docs/how-to/goodput.md): this run's seconds per category, and
    #: every run's on this root added up (the file ``<root>/.asyncckpt-goodput.json``)
    #: (measurements of time, left out of ``==``: two snapshots of one engine's state compare
    #: equal however long apart they were taken)
    goodput_run: RunRecord | None = field(default=None, compare=False)
    goodput: Goodput | None = field(default=None, compare=False)
    #: memory saves not taken (``handle.skipped``) because a disk write held the memory tier's
    #: other slot: training does not wait for a write; the first is logged at INFO
    memory_saves_skipped: int = 0


# ------------------------------------------------------------------ figures read back from disk
# Every committed checkpoint's manifest records its save's figures (manifest.build_manifest:
# ``manifest["stats"]``, plus the top-level ``bytes`` and ``committed_at``). These read them
# back for ``python -m asyncckpt stats``; nothing here imports torch or matplotlib up front.

#: The seconds-valued figures a manifest's ``stats`` holds.
SECONDS = (
    "blocked_seconds",
    "stage_seconds",
    "wait_seconds",
    "alloc_seconds",
    "write_seconds",
    "paused_seconds",
    "manifest_seconds",
)


@dataclass
class RecordedStats:
    """One checkpoint's figures as its manifest records them; None where it has none.

    Manifests written before the figures were recorded have ``bytes`` and ``committed_at``
    only. ``manifest_seconds`` is the part of ``SaveStats.commit_seconds`` known when the
    manifest was written (its checksum pass; the rename and the tracker come after).
    """

    step: int
    path: Path | str  # a URL (str) for a checkpoint in an object store
    committed_at: float | None = None
    bytes: int | None = None
    staged_bytes: int | None = None
    blocked_seconds: float | None = None
    stage_seconds: float | None = None
    wait_seconds: float | None = None
    alloc_seconds: float | None = None
    write_seconds: float | None = None
    paused_seconds: float | None = None
    manifest_seconds: float | None = None
    throughput_bytes_per_s: float | None = None
    #: "memory" for a memory-tier checkpoint written by its worker, and why (memory/tier.py)
    tier: str = "disk"
    persisted_because: str | None = None
    #: why the manifest could not be read (the checkpoint is listed all the same)
    error: str | None = None

    @property
    def has_figures(self) -> bool:
        return any(getattr(self, k) is not None for k in SECONDS)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def _number(value: Any) -> float | None:
    """A finite number, or None (a missing, hand-edited or newer-version field)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    n = _number(value)
    return int(n) if n is not None and n >= 0 else None


def record_from_manifest(step: int, path: Path | str, manifest: Mapping[str, Any]) -> RecordedStats:
    """The figures of one parsed manifest (any missing or malformed field is None)."""
    raw = manifest.get("stats")
    fig: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    r = RecordedStats(
        step,
        path,
        committed_at=_number(manifest.get("committed_at")),
        bytes=_count(manifest.get("bytes")),
        staged_bytes=_count(fig.get("staged_bytes")),
        throughput_bytes_per_s=_number(fig.get("throughput_bytes_per_s")),
        tier=str(manifest.get("tier") or "disk"),
        persisted_because=manifest.get("persisted_because"),
    )
    for k in SECONDS:
        setattr(r, k, _number(fig.get(k)))
    if r.blocked_seconds is None and r.stage_seconds is not None and r.wait_seconds is not None:
        r.blocked_seconds = r.stage_seconds + r.wait_seconds + (r.alloc_seconds or 0.0)
    if r.throughput_bytes_per_s is None and r.bytes is not None and r.write_seconds:
        r.throughput_bytes_per_s = r.bytes / r.write_seconds
    return r


def read_stats(root: str | os.PathLike, layout: str | None = None) -> list[RecordedStats]:
    """The recorded figures of every committed checkpoint of ``root``, oldest first.

    ``layout`` is detected from the directory names when None. A checkpoint whose manifest is
    unreadable is listed with ``error`` set and no figures.
    """

    root = check_local_root(root)
    layout = layout or detect_layout(root)
    records = []
    for c in _layout.scan(root, layout):
        try:
            manifest = read_manifest(c.path)
        except (CheckpointError, OSError) as e:
            records.append(RecordedStats(c.step, Path(c.path), error=str(e)))
            continue
        if not isinstance(manifest, Mapping):
            records.append(RecordedStats(c.step, Path(c.path), error="manifest is not an object"))
            continue
        records.append(record_from_manifest(c.step, Path(c.path), manifest))
    return records


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(records: list[RecordedStats]) -> dict[str, Any]:
    """Median and p90 stall, median throughput, total bytes (None where no figure is known)."""
    stalls = [r.blocked_seconds for r in records if r.blocked_seconds is not None]
    writes = [r.write_seconds for r in records if r.write_seconds is not None]
    rates = [r.throughput_bytes_per_s for r in records if r.throughput_bytes_per_s is not None]
    return {
        "checkpoints": len(records),
        "with_figures": sum(r.has_figures for r in records),
        "median_stall_seconds": statistics.median(stalls) if stalls else None,
        "p90_stall_seconds": _percentile(stalls, 90),
        "max_stall_seconds": max(stalls) if stalls else None,
        "median_write_seconds": statistics.median(writes) if writes else None,
        "median_throughput_bytes_per_s": statistics.median(rates) if rates else None,
        "total_bytes": sum(r.bytes for r in records if r.bytes is not None),
    }


def plot_stats(
    records: list[RecordedStats], path: str | os.PathLike, title: str | None = None
) -> Path:
    """Write a PNG: stall and write seconds vs step (top), throughput vs step (bottom).

    Needs matplotlib (the ``bench`` extra); raises ``ImportError`` saying so without it, and
    ``ValueError`` if no checkpoint records any figure.
    """
    shown = [r for r in records if r.has_figures]
    if not shown:
        raise ValueError(
            "no checkpoint records save figures (manifests written before asyncckpt recorded "
            "them have none); nothing to plot"
        )
    try:
        # The object API with the Agg canvas: no pyplot, no global backend switched.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError(
            "plotting needs matplotlib: pip install 'asyncckpt[bench]' (or matplotlib)"
        ) from e
    fig = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)

    def series(name: str) -> tuple[list[int], list[float]]:
        pts = [(r.step, getattr(r, name)) for r in shown if getattr(r, name) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    top.plot(*series("blocked_seconds"), marker="o", label="stall (training blocked)")
    top.plot(*series("write_seconds"), marker="s", label="write (background)")
    top.set_ylabel("seconds")
    top.legend()
    top.grid(alpha=0.3)
    steps, rates = series("throughput_bytes_per_s")
    bottom.plot(steps, [v / 1e6 for v in rates], marker="o", color="tab:green")
    bottom.set_ylabel("write throughput (MB/s)")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.grid(alpha=0.3)
    if title:
        top.set_title(title)
    out = Path(path)
    fig.savefig(out, format="png", dpi=100)
    return out
