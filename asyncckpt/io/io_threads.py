"""How many shard files the worker writes at once: ``ThrottleConfig(io_threads=...)``.

A number is used as given. ``"auto"`` (the default preset's) adapts each save to the cores the
trainer leaves idle: on the GPU machine's NVMe (an H200 host, 2026-11-27) one raw writer
moved 0.97 GB/s and two or four 1.73 GB/s, while one file at a time left asyncckpt at 0.56x the
best of them. But a trainer that keeps the CPU busy (optimizer offload, data loading) must not
lose cores to the writer, so the count follows what the CPU did since the last save:

- idle cores are read over the interval since the previous save, on the cores the worker may
  run on (per CPU id from ``/proc/stat``; elsewhere psutil's per-core times, and where ids and
  positions cannot be matched the machine's idle time scaled to the allowed cores), plus the
  cores the worker itself used meanwhile (its own last write is not the trainer's load); under
  a cgroup CPU quota (a Kubernetes limit) no more than the quota left unused (cpu_limits.py);
- those are shared among the workers that may run on the same cores: one per local rank
  (``local_workers``), scaled by the share of the job's CPU set (its cgroup's ``cpuset``) each
  may use: ranks pinned to their own cores each see only theirs. Where no cgroup names the
  CPU set, every local worker is taken to share the cores this one may use (a restricted
  affinity may be the job's, shared by all its ranks: never more threads than cores);
- one file per whole idle core of that share, at least 1 and at most ``AUTO_MAX``.

Any reading that fails (an OS or container that refuses it) makes that save write one file at
a time, said once in the log. The decision is pure (``auto_count``); ``IoThreads`` takes the
readings.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from asyncckpt.io import cpu_limits

log = logging.getLogger("asyncckpt.io.throttle")

#: ``io_threads="auto"``: never more files at once than this (4 raw writers gained nothing over
#: 2 on the GPU machine's disk; more threads only add seeks on a disk that is not NVMe).
AUTO_MAX = 4
IoThreadsSetting = int | Literal["auto"]


def check_setting(value: object) -> None:
    """``ValueError`` unless ``value`` is an int >= 1 or ``"auto"``."""
    if value == "auto" and isinstance(value, str):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"io_threads must be an int >= 1 or 'auto', got {value!r}")


def auto_count(idle_cores: float, workers_per_node: float = 1, cap: int = AUTO_MAX) -> int:
    """Files written at once under ``"auto"``: one per whole idle core of this worker's share of
    the idle cores, at least 1, at most ``cap``."""
    share = max(0.0, idle_cores) / max(1.0, workers_per_node)
    return max(1, min(cap, int(share)))


def local_workers(dist: Any = None) -> int:
    """How many workers write from this node: node-local roots name it
    (``DistConfig.ranks_per_node``), else the launcher's local world size (torchrun's
    ``$LOCAL_WORLD_SIZE``, Open MPI's ``$OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's
    ``$MPI_LOCALNRANKS``, then Slurm's ``$SLURM_NTASKS_PER_NODE``: the allocation's, which an
    ``mpirun`` inside it may exceed), else 1."""
    per_node = getattr(dist, "ranks_per_node", None)
    if isinstance(per_node, int) and per_node > 0:
        return per_node
    for var in LOCAL_SIZE_VARS:
        m = re.match(r"\s*(\d+)", os.environ.get(var, ""))  # Slurm may say "8(x2)"
        if m and int(m.group(1)) > 0:
            return int(m.group(1))
    return 1


#: The launchers' local world sizes, most specific first.
LOCAL_SIZE_VARS = (
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",
)
#: Per-CPU times, by CPU id (offline CPUs have no line: ids are not list positions).
PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuReading:
    """One look at the CPU: when, idle seconds per CPU id, the machine's idle seconds, the
    cores the worker may use, the job's CPU set (its cgroup's; None: no cgroup names one), its
    own CPU seconds, and the cgroup's quota."""

    at: float
    per_core_idle: Mapping[int, float]
    total_idle: float
    cores: tuple[int, ...]
    own: float
    quota: tuple[float, float] | None
    pool: frozenset[int] | None = None


def per_cpu_idle(stat: Path = PROC_STAT) -> dict[int, float] | None:
    """Idle + iowait seconds per CPU id from ``/proc/stat``; None where it cannot be read."""
    try:
        text = stat.read_text()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    idle: dict[int, float] = {}
    for m in re.finditer(r"^cpu(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+)", text, re.M):
        idle[int(m.group(1))] = (int(m.group(5)) + int(m.group(6))) / tick
    return idle or None


def read_cpu() -> CpuReading:
    """Raises what psutil raises where the OS refuses (the caller falls back to one file)."""
    proc = psutil.Process()
    try:
        cores = tuple(sorted(proc.cpu_affinity() or []))
    except AttributeError:  # no affinity on macOS
        cores = ()
    per_core = per_cpu_idle()
    if per_core is None:  # not Linux: psutil's positions stand for the ids
        times = psutil.cpu_times(percpu=True)
        per_core = {i: c.idle + getattr(c, "iowait", 0.0) for i, c in enumerate(times)}
    total = psutil.cpu_times()
    return CpuReading(
        at=time.monotonic(),
        per_core_idle=per_core,
        total_idle=total.idle + getattr(total, "iowait", 0.0),
        cores=cores,
        own=sum(proc.cpu_times()[:2]),
        quota=cpu_limits.quota(),
        pool=cpu_limits.cpuset(),
    )


def idle_between(before: CpuReading, after: CpuReading) -> tuple[float, float]:
    """Pure: (idle cores the worker could have used over the interval, the share of the job's
    CPU set it may use). See the module's docstring."""
    span = after.at - before.at
    if span <= 0:
        return 0.0, 1.0
    ncpu = len(after.per_core_idle) or 1
    cores = after.cores or tuple(sorted(after.per_core_idle))
    # Of the job's CPU set, the part this worker may use; with none named, all of it (the
    # affinity may be the job's own, shared by every local rank).
    pool = after.pool
    share = len(pool.intersection(cores)) / len(pool) if pool else 1.0
    numbered = all(c in before.per_core_idle and c in after.per_core_idle for c in cores)
    if numbered:
        idle = sum(after.per_core_idle[c] - before.per_core_idle[c] for c in cores)
    else:  # ids not in the per-CPU times: the machine's idle, the allowed cores' part of it
        idle = (after.total_idle - before.total_idle) * min(1.0, len(cores) / ncpu)
    own = after.own - before.own
    # Never more than the cores it may use: /proc/stat counts in ticks (10 ms), so over a
    # short interval the idle time read can overshoot the interval itself.
    free = min((idle + own) / span, float(len(cores)))
    if before.quota is not None and after.quota is not None:
        quota, used = after.quota[0], after.quota[1] - before.quota[1]
        free = min(free, quota - used / span + own / span)  # the quota's unused part
    return max(0.0, free), share


class IoThreads:
    """The worker's io-thread count: ``now()`` before each save's write."""

    def __init__(self, setting: IoThreadsSetting = 1, workers_per_node: int = 1) -> None:
        check_setting(setting)
        self.setting = setting
        self.workers_per_node = max(1, workers_per_node)
        self._ran: list[int] = []  # what its writers ran (``WriteOptions.threads_used``)
        self._before: CpuReading | None = None
        self._failed = False
        if setting == "auto":
            self._before = self._read()  # the first interval starts now

    def _read(self) -> CpuReading | None:
        try:
            return read_cpu()
        except Exception as e:  # psutil's AccessDenied, an unreadable /proc: one file at a time
            if not self._failed:
                log.warning("io_threads auto: cannot read the CPU (%r): one file at a time", e)
            self._failed = True
            return None

    def idle_cores(self) -> tuple[float, float]:
        """Idle cores since the last reading (see ``idle_between``) and this worker's share of
        the machine; (0, 1) where no reading could be taken."""
        before, after = self._before, self._read()
        self._before = after
        if before is None or after is None:
            return 0.0, 1.0
        return idle_between(before, after)

    def write_options(self) -> dict[str, Any]:
        """``staged.write``'s ``thread_count`` for the save about to be written (``now``), and
        the list its writers fill with what they ran (``used``)."""
        self._ran = []
        return {"thread_count": self.now(), "threads_used": self._ran}

    def wrote_one_at_a_time(self) -> None:
        """The save was written one file at a time whatever the setting (chunked saves)."""
        self._ran = [1]

    @property
    def used(self) -> int:
        """Files the last save's writers wrote at once (``SaveStats.io_threads``): what ran,
        which may be fewer than ``now`` chose (fewer files than threads; a one-file format)."""
        return max(self._ran, default=1)

    def now(self) -> int:
        """The count for the save about to be written (logged at DEBUG under ``"auto"``)."""
        if isinstance(self.setting, int):
            return self.setting
        idle, share = self.idle_cores()
        # Workers pinned to their own cores each see only theirs: share those among fewer.
        count = auto_count(idle, max(1.0, self.workers_per_node * share))
        log.debug("io_threads auto: %.1f idle core(s) since the last save: %d", idle, count)
        return count
