"""Throttling of the background writer: priority, cores, threads, I/O priority and write rate.

With optimizer offload the CPU runs the optimizer step, so the checkpoint worker must not take
cycles, cores or disk bandwidth from it (invariant 7, docs/design.md). The worker is a process, so
each lever applies to it as a whole:

* ``nice``            -- ``os.nice``: the scheduler prefers the trainer when both want a core.
* ``cpu_cores``       -- CPU affinity: the worker stays on the *last* cores, the trainer keeps
                         the first ones (where thread pools usually start).
* ``compute_threads`` -- torch / OpenMP / MKL pools: one thread cannot fan out over all cores.
* ``ionice``          -- idle I/O class: the trainer's own reads (data loading) go first.
* ``io_threads``      -- how many files are written at once; ``"auto"`` follows the cores the
                         trainer left idle since the last save (io_threads.py).
* ``write_rate_bytes_per_s`` -- a token bucket (``RateLimiter``), applied by the worker's
                         ``Pacer`` before every piece of a shard it writes.
* ``direct_io``       -- ``O_DIRECT`` shard files (``directio.py``): no page-cache copy and no
                         kernel writeback outside the worker, so the other levers cover it all.
* pause hint          -- ``WritePause``: the trainer marks its optimizer step (or any CPU-heavy
                         region) and the worker holds its writes between 1 MiB pieces until
                         the region ends (at most ``max_pause_seconds`` per region).
* ``durable_within``  -- a bound on the time from ``save`` to durable: once half of it has
                         gone by, the worker escalates (``Pacer.escalate``): the rate cap and
                         the pause hint stop holding it, and its threads go back to the
                         priority and I/O class they had before the throttle (where the OS
                         allows: lowering niceness needs root or ``RLIMIT_NICE``). The next
                         save starts throttled again.

``apply_throttle`` is best-effort: an OS that refuses a lever gets a warning and a note in the
returned ``AppliedThrottle``, never an exception, since a checkpoint is worth more than a nicety.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import psutil

from asyncckpt.core.walltime import OverlapClock
from asyncckpt.io.io_threads import IoThreadsSetting
from asyncckpt.io.io_threads import check_setting as check_io_threads

log = logging.getLogger("asyncckpt.io.throttle")

#: Bucket size of a RateLimiter, in seconds of rate: absorbs jitter without long bursts.
DEFAULT_BURST_SECONDS = 0.25
_MIN_BURST_BYTES = 64 * 1024


@dataclass(frozen=True)
class ThrottleConfig:
    """How the checkpoint worker process is throttled. The default changes nothing.

    ``cpu_cores`` is either an explicit set of core ids or a count ``n``: the last ``n`` cores
    the process may use (on a node with several ranks, each local rank's worker the ``n``
    before the next rank's: ``worker_cores``). ``None`` leaves affinity, threads or rate unchanged.
    """

    nice: int = 0
    cpu_cores: Sequence[int] | int | None = None
    compute_threads: int | None = None
    io_threads: IoThreadsSetting = 1
    write_rate_bytes_per_s: float | None = None
    ionice: bool = False
    direct_io: bool = False
    max_pause_seconds: float = 2.0
    durable_within: float | None = None
    #: fail a save whose worker shows no sign of life for this many seconds (``WriteTimeout``;
    #: the hung worker is killed and replaced); None: never (600 s for an orphaned worker)
    write_timeout: float | None = None

    def __post_init__(self) -> None:
        # bool is an int subclass; nice=True or cpu_cores=True are almost surely mistakes.
        if not _is_int(self.nice) or not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be an int in 0..19 (added niceness), got {self.nice!r}")
        cores = self.cpu_cores
        if cores is not None:
            if _is_int(cores):
                if cores < 1:
                    raise ValueError(f"cpu_cores as a count must be >= 1, got {cores!r}")
            elif isinstance(cores, (str, bytes)) or not isinstance(cores, Sequence):
                raise ValueError(
                    f"cpu_cores must be a sequence of core ids, a count or None, got {cores!r}"
                )
            else:
                ids = tuple(cores)
                if not ids:
                    raise ValueError("cpu_cores must not be empty (use None for no pinning)")
                if not all(_is_int(c) and c >= 0 for c in ids):
                    raise ValueError(f"cpu_cores must hold core ids >= 0, got {cores!r}")
                if len(set(ids)) != len(ids):
                    raise ValueError(f"cpu_cores has duplicates: {cores!r}")
                # A tuple keeps the frozen config hashable and cheap to pickle to the worker.
                object.__setattr__(self, "cpu_cores", tuple(sorted(ids)))
        if self.compute_threads is not None and (
            not _is_int(self.compute_threads) or self.compute_threads < 1
        ):
            raise ValueError(
                f"compute_threads must be an int >= 1 or None, got {self.compute_threads!r}"
            )
        check_io_threads(self.io_threads)
        rate = self.write_rate_bytes_per_s
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1e18
        ):
            raise ValueError(
                f"write_rate_bytes_per_s must be a positive number or None, got {rate!r}"
            )
        if not isinstance(self.ionice, bool):
            raise ValueError(f"ionice must be a bool, got {self.ionice!r}")
        if not isinstance(self.direct_io, bool):
            raise ValueError(f"direct_io must be a bool, got {self.direct_io!r}")
        mp = self.max_pause_seconds
        if isinstance(mp, bool) or not isinstance(mp, (int, float)) or not 0 <= mp < 1e9:
            raise ValueError(f"max_pause_seconds must be a number >= 0, got {mp!r}")
        check_durable_within(self.durable_within)
        wt = self.write_timeout
        if wt is not None and (
            isinstance(wt, bool) or not isinstance(wt, (int, float)) or not 0 < wt < 1e9
        ):
            raise ValueError(f"write_timeout must be a number of seconds > 0 or None, got {wt!r}")

    @classmethod
    def off(cls) -> ThrottleConfig:
        """No throttling: full priority, all cores, two files written at once, page cache."""
        return cls(io_threads=2, max_pause_seconds=0.0)

    @classmethod
    def background(cls, **changes: Any) -> ThrottleConfig:
        """The default: full speed while the CPU is idle, out of the training's way when not.

        nice 19 (the worker runs at full speed on an idle core, and the trainer wins any core
        both want), one compute thread (the worker only copies bytes), as many files written
        at once as the trainer left cores idle since the last save (``io_threads="auto"``: 1
        to 4), ``O_DIRECT`` (no page-cache copy, no writeback by kernel threads outside the
        worker). No core pinning: the default makes no
        assumption about which cores the trainer and its data loaders use.
        """
        preset = cls(nice=19, compute_threads=1, io_threads="auto", direct_io=True)
        return dataclasses.replace(preset, **changes)  # e.g. durable_within=60

    @classmethod
    def for_optimizer_offload(
        cls, write_rate_bytes_per_s: float | None = None, **changes: Any
    ) -> ThrottleConfig:
        """The preset for optimizer offload (``throttle=ThrottleConfig.for_optimizer_offload()``): lowest priority, the last core, one thread.

        No rate cap by default: with the idle I/O class and one writer thread the disk is the
        only thing the worker can saturate, and an optimizer step does not use it. Pair it with
        ``engine.pause_writes_during(optimizer)`` so the worker also steps aside for the
        optimizer's memory bandwidth.
        """
        preset = cls(
            nice=19,
            cpu_cores=1,
            compute_threads=1,
            io_threads=1,
            write_rate_bytes_per_s=write_rate_bytes_per_s,
            ionice=True,
            direct_io=True,
        )
        return dataclasses.replace(preset, **changes)


def check_durable_within(value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9
    ):
        raise ValueError(f"durable_within must be a number of seconds > 0 or None, got {value!r}")


#: With ``durable_within=D``, the worker escalates once ``D * ESCALATE_AT`` seconds have gone
#: by since ``save`` was called: the rest of the budget is for writing at full speed.
ESCALATE_AT = 0.5


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def resolve(optimizer_offload: bool, throttle: ThrottleConfig | None) -> ThrottleConfig:
    """The config the engine hands its worker: an explicit one wins, else the matching preset
    (``for_optimizer_offload`` or the default ``background``)."""
    if throttle is not None:
        if not isinstance(throttle, ThrottleConfig):
            raise ValueError(f"throttle must be a ThrottleConfig or None, got {throttle!r}")
        return throttle
    return (
        ThrottleConfig.for_optimizer_offload() if optimizer_offload else ThrottleConfig.background()
    )


@dataclass
class AppliedThrottle:
    """What ``apply_throttle`` did in the worker; plain data so it pickles back to the engine.

    ``applied`` maps a lever to the value now in effect; ``failed`` maps it to the reason.
    """

    pid: int
    config: ThrottleConfig
    applied: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def apply_throttle(config: ThrottleConfig, local_rank: int = 0) -> AppliedThrottle:
    """Apply ``config`` to the calling process, best-effort. Call once at worker start.

    ``local_rank`` picks which block of cores a ``cpu_cores`` count means (``worker_cores``).
    """
    result = AppliedThrottle(pid=os.getpid(), config=config)
    proc = psutil.Process()
    # Where escalation (durable_within) goes back to.
    if config.durable_within is not None and hasattr(os, "getpriority"):
        result.applied["base_nice"] = os.getpriority(os.PRIO_PROCESS, 0)

    def attempt(lever: str, fn: Callable[[], Any]) -> None:
        try:
            result.applied[lever] = fn()
        except Exception as exc:  # any refusal is a warning, never fatal
            reason = f"{type(exc).__name__}: {exc}"
            result.failed[lever] = reason
            log.warning("throttle: could not set %s (%s); continuing without it", lever, reason)

    if config.nice:
        # os.nice adds to the current value and the kernel clamps at 19; report the result.
        attempt("nice", lambda: os.nice(config.nice))
    if config.cpu_cores is not None:
        attempt("cpu_cores", lambda: _set_affinity(proc, config.cpu_cores, local_rank))
    if config.ionice:
        attempt("ionice", lambda: _set_low_io_priority(proc))
    if config.compute_threads is not None:
        _set_threads(config.compute_threads, attempt)
    # Levers the writer applies itself; recorded so the report shows the whole config.
    result.applied["io_threads"] = config.io_threads
    result.applied["write_rate_bytes_per_s"] = config.write_rate_bytes_per_s
    result.applied["direct_io"] = config.direct_io
    return result


def worker_cores(allowed: Sequence[int], count: int, local_rank: int = 0) -> list[int]:
    """The ``count`` cores a worker takes when ``cpu_cores`` is a count: counted from the end
    of the allowed set, each local rank its own block (rank 0 the last ``count`` cores, rank 1
    the ``count`` before them, ...), so the workers of several GPUs on one node do not all
    pile onto the last core. Wraps around when the node has fewer cores than ranks x count.
    """
    cores = sorted(allowed)
    if not cores:
        raise ValueError("no allowed cores")
    n = min(count, len(cores))
    end = len(cores) - (local_rank * n) % len(cores)
    picked = [cores[(end - n + i) % len(cores)] for i in range(n)]
    return sorted(picked)


def _set_affinity(
    proc: psutil.Process, cores: Sequence[int] | int | None, local_rank: int = 0
) -> list[int]:
    # cpu_affinity is missing on macOS: the AttributeError is reported as a refused lever.
    allowed = sorted(proc.cpu_affinity())
    if isinstance(cores, int):  # ThrottleConfig refused bools already
        # The last cores: the trainer's thread pools start from the first ones.
        wanted = worker_cores(allowed, cores, local_rank)
        if cores > len(allowed):
            log.warning("throttle: %d cores asked, only %d allowed", cores, len(allowed))
    elif cores is None:
        return allowed
    else:
        wanted = [c for c in cores if c in allowed]
        if not wanted:
            raise ValueError(f"none of cores {list(cores)} is allowed (allowed: {allowed})")
        if len(wanted) < len(cores):
            log.warning("throttle: cores %s not allowed, using %s", list(cores), wanted)
    proc.cpu_affinity(wanted)
    return sorted(proc.cpu_affinity())


def _set_low_io_priority(proc: psutil.Process) -> str:
    if psutil.WINDOWS:
        proc.ionice(psutil.IOPRIO_VERYLOW)
        return "verylow"
    if not hasattr(psutil, "IOPRIO_CLASS_IDLE"):
        raise NotImplementedError("I/O priority is not supported on this platform")
    try:
        proc.ionice(psutil.IOPRIO_CLASS_IDLE)
        return "idle"
    except (psutil.Error, OSError) as exc:
        # Some kernels/containers refuse the idle class; the lowest best-effort level is next.
        log.info("throttle: idle I/O class refused (%s); trying best-effort 7", exc)
        proc.ionice(psutil.IOPRIO_CLASS_BE, 7)
        return "best-effort 7"


def _set_threads(n: int, attempt: Callable[[str, Callable[[], Any]], None]) -> None:
    # The environment first: it reaches OpenMP/MKL runtimes loaded later and child processes.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    import torch  # late: the throttle module itself need not pull in torch

    def intra() -> int:
        torch.set_num_threads(n)
        return torch.get_num_threads()

    def interop() -> int:
        # Only allowed before any inter-op work has run in this process; else it raises.
        torch.set_num_interop_threads(n)
        return torch.get_num_interop_threads()

    attempt("compute_threads", intra)
    attempt("interop_threads", interop)


class RateLimiter:
    """Thread-safe token bucket: ``acquire(n)`` sleeps so bytes stay under ``rate`` per second.

    Requests larger than the bucket are allowed and go into debt, so the caller's chunk size
    need not fit the bucket: N bytes take at least ``(N - burst) / rate`` seconds in total.
    ``rate=None`` makes every call a no-op.
    """

    def __init__(
        self,
        rate_bytes_per_s: float | None,
        burst_bytes: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate_bytes_per_s is not None and not rate_bytes_per_s > 0:
            raise ValueError(f"rate_bytes_per_s must be > 0 or None, got {rate_bytes_per_s!r}")
        if burst_bytes is not None and burst_bytes < 1:
            raise ValueError(f"burst_bytes must be >= 1, got {burst_bytes!r}")
        self.rate = rate_bytes_per_s
        if burst_bytes is None:
            burst_bytes = int(
                max(_MIN_BURST_BYTES, (rate_bytes_per_s or 0) * DEFAULT_BURST_SECONDS)
            )
        self.burst_bytes = burst_bytes
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst_bytes)  # start full: the first burst goes out at once
        self._last = clock()
        self.bytes_acquired = 0

    def acquire(self, nbytes: int, held: OverlapClock | None = None) -> float:
        """Take ``nbytes`` from the bucket, sleeping while in debt (inside a span of ``held``,
        the caller's clock of the save's held time). Returns seconds slept."""
        if self.rate is None or nbytes <= 0:
            return 0.0
        # Reserve under the lock, sleep outside it: concurrent writers queue up in debt order
        # instead of holding the lock while asleep.
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.bytes_acquired += nbytes
        if wait > 0:
            with held.span() if held is not None else contextlib.nullcontext():
                self._sleep(wait)
        return wait


class WritePause:
    """The trainer's "CPU busy, hold the writes" hint, in shared memory the worker can read.

    Two counters: ``depth`` (regions open now; the trainer's threads may nest them) and
    ``entries`` (regions ever entered, so the worker can tell one long region from the next).
    Only the trainer writes them, under its own lock; the worker only reads. Created in the
    trainer with a spawn context and handed to the worker process when it starts.
    """

    def __init__(self, ctx: Any) -> None:
        self._counts = ctx.RawArray("q", 2)  # [depth, entries]
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self._counts[1] += 1
            self._counts[0] += 1

    def exit(self) -> None:
        with self._lock:
            self._counts[0] = max(0, self._counts[0] - 1)

    @property
    def active(self) -> bool:
        return self._counts[0] > 0

    @property
    def entries(self) -> int:
        return self._counts[1]

    def __getstate__(self) -> dict[str, Any]:
        return {"counts": self._counts}  # the lock is the trainer's own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._counts = state["counts"]
        self._lock = threading.Lock()


class Pacer:
    """Called by the worker before each piece it writes: the rate cap, then the pause hint.

    A region the trainer keeps open longer than ``max_pause_seconds`` stops holding the writes
    (for the rest of that region), so a checkpoint always finishes and back-pressure cannot
    turn into a deadlock; ``max_pause_seconds=0`` ignores the hint.

    With ``durable_within``: ``begin(saved_at)`` at the start of each save arms a timer for the
    escalation (``escalate``); from then on this save is neither rate-capped nor paused, and
    ``renice`` (the worker's: back to full priority) has run. ``figures()`` says what it did.
    """

    POLL_SECONDS = 0.001

    def __init__(
        self,
        limiter: RateLimiter | None,
        pause: WritePause | None,
        max_pause_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        durable_within: float | None = None,
        renice: Callable[[bool], list[str]] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._limiter = limiter
        self._pause = pause if max_pause_seconds > 0 else None
        self._max_pause = max_pause_seconds
        self._clock = clock
        self._sleep = sleep
        self._given_up_on = -1  # the region (by entry count) whose pause ran out
        # Wall time while at least one writer thread waits out a pause (not their sum), and
        # while at least one is held by either lever (one thread may sleep on the rate cap
        # while another waits out the pause: that time counts once).
        self._paused = OverlapClock(clock)
        self._held = OverlapClock(clock)
        self.durable_within = durable_within
        self._renice = renice
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._saved_at: float | None = None
        #: seconds into the save (from its ``save`` call) at which it escalated; None: not
        self.escalated_after: float | None = None
        #: the levers escalation released (``write_rate``, ``pause``, ``nice``, ``ionice``)
        self.escalations: list[str] = []

    def begin(self, saved_at: float | None) -> None:
        """A new save (``saved_at``: unix time of its ``save`` call): throttled again."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self.escalated_after is not None and self._renice is not None:
                self._renice(False)
            self.escalated_after = None
            self.escalations = []
            self._paused.reset()
            self._held.reset()
            self._saved_at = saved_at
            if self.durable_within is None or saved_at is None:
                return
            wait = saved_at + self.durable_within * ESCALATE_AT - self._wall()
            if wait <= 0:
                self._escalate_locked()
                return
            # A timer, not only the next piece: a worker starved of CPU may take long to get
            # to it, and the renice is what gets it running again.
            self._timer = threading.Timer(wait, self.escalate)
            self._timer.daemon = True
            self._timer.start()

    def end(self) -> None:
        """The save is over: no escalation for it any more (the next ``begin`` de-escalates)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def escalate(self) -> None:
        with self._lock:
            if self.escalated_after is None and self._saved_at is not None:
                self._escalate_locked()

    def _escalate_locked(self) -> None:
        assert self._saved_at is not None
        self.escalated_after = max(0.0, self._wall() - self._saved_at)
        levers = []
        if self._limiter is not None and self._limiter.rate is not None:
            levers.append("write_rate")
        if self._pause is not None:
            levers.append("pause")
        if self._renice is not None:
            levers.extend(self._renice(True))
        self.escalations = levers
        log.info(
            "durable_within: %.1f s into the save, writing at full speed (%s)",
            self.escalated_after,
            ", ".join(levers) or "nothing was throttled",
        )

    @property
    def throttled_seconds(self) -> float:
        """Wall time this save's writes were held: by the rate cap or by the pause hint."""
        return self._held.seconds

    def figures(self) -> dict[str, Any]:
        return {
            "throttled_seconds": self.throttled_seconds,
            "escalated_after_seconds": self.escalated_after,
            "escalations": list(self.escalations),
        }

    def __call__(self, nbytes: int) -> None:
        if self.escalated_after is not None:
            return  # the deadline is near: neither capped nor paused
        if self._limiter is not None:
            self._limiter.acquire(nbytes, held=self._held)
        pause = self._pause
        if pause is None or not pause.active:
            return
        with self._held.span(), self._paused.span():
            start = self._clock()
            region = pause.entries
            while pause.active:
                now = self._clock()
                if pause.entries != region:  # the trainer moved on to a new region: wait anew
                    region, start = pause.entries, now
                elif region == self._given_up_on:
                    break
                elif self.escalated_after is not None or now - start >= self._max_pause:
                    self._given_up_on = region
                    log.info("pause hint held the writes %.1f s; writing on", self._max_pause)
                    break
                self._sleep(self.POLL_SECONDS)

    @property
    def paused_seconds(self) -> float:
        """Wall time this save's writes waited out the pause hint."""
        return self._paused.seconds


def write_all(raw: Any, chunk: memoryview) -> None:
    """Write all of ``chunk``: a raw (unbuffered) file may write less than asked."""
    while chunk:
        n = raw.write(chunk)
        if n is None:
            raise BlockingIOError("file is non-blocking and would block")
        chunk = chunk[n:]


def renicer(config: ThrottleConfig, applied: AppliedThrottle | None) -> Callable[[bool], list[str]]:
    """The worker's escalation: ``renice(True)`` gives every thread of the process the nice
    value and I/O class it had before the throttle, ``renice(False)`` the throttled ones back.
    Best-effort: returns the levers it changed (a refusal is logged, not raised)."""
    base = (applied.applied.get("base_nice") if applied else None) or 0
    throttled = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else base

    def tids() -> list[int]:
        try:
            return [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return [0]

    def renice(up: bool) -> list[str]:
        done = []
        if config.nice and hasattr(os, "setpriority"):
            try:
                for tid in tids():  # niceness is per thread on Linux
                    os.setpriority(os.PRIO_PROCESS, tid, base if up else throttled)
                done.append("nice")
            except OSError as e:
                log.warning("durable_within: could not change the worker's niceness (%s)", e)
        if config.ionice and hasattr(psutil, "IOPRIO_CLASS_BE"):
            try:
                for tid in tids():
                    p = psutil.Process(tid) if tid else psutil.Process()
                    if up:
                        p.ionice(psutil.IOPRIO_CLASS_BE, 4)
                    else:
                        p.ionice(psutil.IOPRIO_CLASS_IDLE)
                done.append("ionice")
            except (psutil.Error, OSError, ValueError) as e:
                log.warning("durable_within: could not change the worker's I/O class (%s)", e)
        return done

    return renice
