"""How many shard files the worker writes at once: ``ThrottleConfig(io_threads=...)``.

A number is used as given. ``"auto"`` (the default preset's) adapts each save to the cores the
trainer leaves idle: on the GPU machine's NVMe (an H200 host, 2026-11-27) one raw writer
moved 0.97 GB/s and two or four 1.73 GB/s, while one file at a time left asyncckpt at 0.56x the
best of them. But a trainer that keeps the CPU busy (optimizer offload, data loading) must not
lose cores to the writer, so the count follows what the CPU did since the last save:

- idle cores are read over the interval since the previous save (psutil's per-core times), on
  the cores the worker may run on, plus the cores the worker itself used meanwhile (its own
  last write is not the trainer's load);
- that is shared among the node's workers (one per local rank), and each writes one file per
  idle core of its share, at least 1 and at most ``AUTO_MAX``.

The decision is pure (``auto_count``); ``IoThreads`` only takes the readings.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Literal

import psutil

log = logging.getLogger("asyncckpt.throttle")

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


def auto_count(idle_cores: float, workers_per_node: int = 1, cap: int = AUTO_MAX) -> int:
    """Files written at once under ``"auto"``: one per whole idle core of this worker's share of
    the node's idle cores, at least 1, at most ``cap``."""
    share = max(0.0, idle_cores) / max(1, workers_per_node)
    return max(1, min(cap, int(share)))


def local_workers(dist: Any = None) -> int:
    """How many workers write from this node: node-local roots name it
    (``DistConfig.ranks_per_node``), else torchrun's ``$LOCAL_WORLD_SIZE``, else 1."""
    per_node = getattr(dist, "ranks_per_node", None)
    if isinstance(per_node, int) and per_node > 0:
        return per_node
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class IoThreads:
    """The worker's io-thread count: ``now()`` before each save's write."""

    def __init__(self, setting: IoThreadsSetting = 1, workers_per_node: int = 1) -> None:
        check_setting(setting)
        self.setting = setting
        self.workers_per_node = max(1, workers_per_node)
        self.last = setting if isinstance(setting, int) else 1
        self._cores: list[int] = []
        self._at = 0.0
        self._cpu_times: list[float] = []
        self._own = 0.0
        if setting == "auto":
            self._read()  # the first interval starts now

    def _read(self) -> tuple[float, float, list[float], float]:
        proc = psutil.Process()
        try:
            self._cores = sorted(proc.cpu_affinity() or [])
        except (AttributeError, OSError):  # no affinity on macOS
            self._cores = []
        idle = [c.idle + getattr(c, "iowait", 0.0) for c in psutil.cpu_times(percpu=True)]
        own = sum(proc.cpu_times()[:2])
        prev = (self._at, self._own, self._cpu_times, 0.0)
        self._at, self._own, self._cpu_times = time.monotonic(), own, idle
        return prev

    def idle_cores(self) -> float:
        """Idle cores (of those the worker may use) since the last reading, plus what the
        worker itself used in that time."""
        at, own, before, _ = self._read()
        span = self._at - at
        if span <= 0 or not before:
            return 0.0
        cores = self._cores or list(range(len(self._cpu_times)))
        idle = sum(
            self._cpu_times[c] - before[c]
            for c in cores
            if c < min(len(before), len(self._cpu_times))
        )
        return max(0.0, (idle + (self._own - own)) / span)

    def now(self) -> int:
        """The count for the save about to be written (logged at DEBUG under ``"auto"``)."""
        if self.setting != "auto":
            return self.last
        idle = self.idle_cores()
        self.last = auto_count(idle, self.workers_per_node)
        log.debug("io_threads auto: %.1f idle core(s) since the last save: %d", idle, self.last)
        return self.last
