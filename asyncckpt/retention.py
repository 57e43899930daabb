"""Retention policies, prune planning and save triggers: pure functions, no disk.

A retention policy answers one question: given the committed checkpoints, which steps are worth
keeping? It is a pure function of ``CheckpointInfo`` values, so it can be tested exhaustively
without a disk and gives the same answer for the same checkpoints in any order. Policies compose
with ``|`` (the union of what each keeps). What a policy may *not* delete -- the newest checkpoint,
the one the tracker names, the one this run resumed from, pinned ones and ones being loaded -- is
decided separately by ``plan_prune``, so no policy, however written, can break invariant 3.

``SaveSchedule`` decides *when* to save (every N steps, every H seconds, on request, after
SIGTERM). It knows nothing of the engine; the engine owns one and asks it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CheckpointInfo",
    "RetentionPolicy",
    "Union",
    "KeepLast",
    "KeepBest",
    "KeepEvery",
    "KeepInterval",
    "KeepSteps",
    "KeepAll",
    "MissingMetricWarning",
    "best_step",
    "metric_warnings",
    "PrunePlan",
    "protected_steps",
    "plan_prune",
    "should_prune",
    "SaveSchedule",
]

SCOPES = ("all", "run")


class MissingMetricWarning(UserWarning):
    """A policy ranks by a metric that some committed checkpoints do not report."""


STORAGES = ("shared", "local")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a policy may look at: one committed checkpoint, as its manifest describes it."""

    step: int
    """The checkpoint's step."""
    committed_at: float
    """Unix time at which it committed."""
    metrics: Mapping[str, float] = field(default_factory=dict, hash=False)
    """The metrics its ``save(..., metrics={...})`` reported (what ``KeepBest`` ranks by)."""
    size_bytes: int = 0
    """Its size on disk, in bytes."""
    run_id: str | None = None
    """The run (engine) that wrote it (what ``Retention(scope="run")`` looks at)."""
    path: Path | None = None
    """Its directory."""
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The user's ``save(..., metadata={...})``: a small JSON object, {} if none."""
    tier: str = "disk"
    """``"disk"``, or ``"memory"`` for a memory-tier save its worker wrote to disk."""
    persisted_because: str | None = None
    """For a memory-tier save written to disk by its worker: why (the trainer's death,
    SIGTERM, ``persist_on_close``)."""

    @classmethod
    def from_manifest(cls, data: Mapping[str, Any], path: Path | None = None) -> CheckpointInfo:
        """Build from a parsed manifest dict (the disk read lives in ``prune.read_checkpoint_info``).

        Non-numeric metric values are skipped rather than rejected: a manifest written by a newer
        version, or by hand, must not make a whole root unprunable.
        """
        metrics = {
            str(k): float(v)
            for k, v in dict(data.get("metrics") or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        run_id = data.get("run_id")
        metadata = data.get("metadata")
        return cls(
            step=int(data["step"]),
            committed_at=float(data.get("committed_at", 0.0)),
            metrics=metrics,
            size_bytes=int(data.get("bytes", 0)),
            run_id=str(run_id) if run_id is not None else None,
            path=path,
            metadata=dict(metadata) if isinstance(metadata, Mapping) else {},
            tier=str(data.get("tier") or "disk"),
            persisted_because=data.get("persisted_because"),
        )


def best_step(checkpoints: Sequence[CheckpointInfo], metric: str, mode: str = "min") -> int | None:
    """The step of the best checkpoint by ``metric`` (lowest for ``mode="min"``, highest for
    ``"max"``), ranked as ``KeepBest`` ranks (ties: the newer; NaN never best). None if there
    are no checkpoints or none has a finite value; ``ValueError`` naming the metrics there are
    when checkpoints exist but none reports ``metric`` (a misspelt name, not "no best yet")."""
    policy = KeepBest(1, metric, mode)  # checks metric and mode
    if not checkpoints:
        return None
    if not any(metric in c.metrics for c in checkpoints):
        present = sorted({k for c in checkpoints for k in c.metrics})
        raise ValueError(
            f"no checkpoint reports the metric {metric!r}; metrics found: {present or 'none'} "
            "(pass it in save(metrics=...))"
        )
    finite = [c for c in checkpoints if metric in c.metrics and not math.isnan(c.metrics[metric])]
    best = policy.keep(finite)
    return next(iter(best)) if best else None


def _check_count(name: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class RetentionPolicy:
    """Base class: ``keep`` maps the committed checkpoints to the set of steps to keep.

    Subclasses implement ``keep``; ``explain`` (steps -> reasons) defaults to ``repr(self)`` as
    the reason for every kept step, which is what ``ls`` and ``prune --dry-run`` print.
    """

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        raise NotImplementedError

    def explain(self, checkpoints: Sequence[CheckpointInfo]) -> dict[int, list[str]]:
        return {step: [repr(self)] for step in sorted(self.keep(checkpoints))}

    def missing_metrics(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        """Metric names this policy ranks by that at least one of ``checkpoints`` lacks, where
        that changes what it keeps (``KeepBest(..., missing="drop")``). Empty: nothing to say."""
        return set()

    def __or__(self, other: RetentionPolicy) -> Union:
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        return Union(*_flatten(self), *_flatten(other))


def _flatten(policy: RetentionPolicy) -> tuple[RetentionPolicy, ...]:
    return policy.policies if isinstance(policy, Union) else (policy,)


@dataclass(frozen=True, repr=False)
class Union(RetentionPolicy):
    """Keeps what any of its policies keeps (built by ``a | b``)."""

    policies: tuple[RetentionPolicy, ...]
    """The policies joined, in order."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        for p in policies:
            if not isinstance(p, RetentionPolicy):
                raise TypeError(f"Union takes RetentionPolicy objects, got {p!r}")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(checkpoints)
        return out

    def explain(self, checkpoints: Sequence[CheckpointInfo]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for p in self.policies:
            for step, reasons in p.explain(checkpoints).items():
                have = out.setdefault(step, [])
                have.extend(r for r in reasons if r not in have)
        return dict(sorted(out.items()))

    def missing_metrics(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        out: set[str] = set()
        for p in self.policies:
            out |= p.missing_metrics(checkpoints)
        return out

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies) if self.policies else "Union()"


@dataclass(frozen=True, repr=False)
class KeepLast(RetentionPolicy):
    """The ``n`` highest steps. ``KeepLast(0)`` keeps nothing beyond what is always protected."""

    n: int
    """How many of the highest steps to keep (0 or more)."""

    def __post_init__(self) -> None:
        _check_count("KeepLast n", self.n)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        steps = sorted({c.step for c in checkpoints})
        return set(steps[max(0, len(steps) - self.n) :]) if self.n else set()

    def __repr__(self) -> str:
        return f"KeepLast({self.n})"


@dataclass(frozen=True, repr=False)
class KeepBest(RetentionPolicy):
    """The ``n`` best checkpoints by ``metric`` (lowest for ``mode="min"``, highest for "max").

    NaN ranks worst (a diverged run must not pin its NaN checkpoint forever). ``ties`` decides
    which of equally good checkpoints wins the last place(s): ``"newer"`` (default; also what
    Orbax's ``BestN`` does) or ``"older"`` (Lightning's ``ModelCheckpoint``, which replaces a
    top-k checkpoint only with a strictly better one). ``missing`` says what happens to checkpoints that do not report the metric:
    ``"drop"`` (default) -- this policy does not keep them (other policies still may);
    ``"keep"`` -- this policy keeps all of them, on top of the ``n`` best, which is the safe
    choice when the metric is only computed on some saves.
    """

    n: int
    """How many of the best checkpoints to keep (0 or more)."""
    metric: str
    """The name of the metric to rank by, as passed in ``save(..., metrics={...})``."""
    mode: str = "min"
    """``"min"``: the lowest values are best (a loss); ``"max"``: the highest (an
    accuracy)."""
    missing: str = "drop"
    """What this policy does with checkpoints that lack the metric: ``"drop"`` (does not
    keep them) or ``"keep"`` (keeps all of them, beside the ``n`` best)."""
    ties: str = "newer"
    """Which of equally good checkpoints wins a last place: ``"newer"`` or ``"older"``."""

    def __post_init__(self) -> None:
        _check_count("KeepBest n", self.n)
        if not isinstance(self.metric, str) or not self.metric:
            raise TypeError(f"KeepBest metric must be a non-empty str, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest mode must be 'min' or 'max', got {self.mode!r}")
        if self.missing not in ("drop", "keep"):
            raise ValueError(f"KeepBest missing must be 'drop' or 'keep', got {self.missing!r}")
        if self.ties not in ("newer", "older"):
            raise ValueError(f"KeepBest ties must be 'newer' or 'older', got {self.ties!r}")

    def _rank_key(self, c: CheckpointInfo) -> tuple[bool, float, int]:
        value = float(c.metrics[self.metric])
        tie = -c.step if self.ties == "newer" else c.step
        if math.isnan(value):
            return (True, 0.0, tie)
        return (False, value if self.mode == "min" else -value, tie)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        by_step = {c.step: c for c in sorted(checkpoints, key=lambda c: c.step)}
        scored = [c for c in by_step.values() if self.metric in c.metrics]
        best = sorted(scored, key=self._rank_key)[: self.n]
        out = {c.step for c in best}
        if self.missing == "keep":
            out |= {c.step for c in by_step.values() if self.metric not in c.metrics}
        return out

    def missing_metrics(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        # With missing="keep" an absent metric only keeps more; with "drop" it can cost the best
        # checkpoint (e.g. KeepBest(1, "val_loss") while saves report {"loss": ...}).
        if self.missing == "keep":
            return set()
        return {self.metric} if any(self.metric not in c.metrics for c in checkpoints) else set()

    def __repr__(self) -> str:
        extra = "" if self.mode == "min" else f", mode={self.mode!r}"
        extra += "" if self.missing == "drop" else f", missing={self.missing!r}"
        extra += "" if self.ties == "newer" else f", ties={self.ties!r}"
        return f"KeepBest({self.n}, {self.metric!r}{extra})"


@dataclass(frozen=True, repr=False)
class KeepEvery(RetentionPolicy):
    """Permanent milestones, ``steps`` apart (kept as long as they exist).

    ``exact=True`` (default; Orbax's ``EveryNSteps(exact_interval=True)``, Orbax's old
    ``keep_period``): every step divisible by ``steps``. For saves that land on round steps.

    ``exact=False`` (Orbax's ``EveryNSteps(exact_interval=False)``), for step-irregular saving:
    walking the checkpoints in step order, keep the first one, then each one at least ``steps``
    steps after the last one kept. With ``steps=100`` and saves at 95, 203, 298, 405 it keeps
    95, 203 (108 after 95) and 405 (202 after 203), not 298 (95 after 203). Milestones are
    spaced from the last kept one, not aligned to multiples of ``steps``, so they can drift
    (saves at 0, 150, 260, 300, 410 keep 0, 150, 260, 410). Deleting checkpoints this policy
    does not keep never changes its answer; deleting one it keeps (by hand, or by another
    policy through ``asyncckpt prune``) re-spaces the later ones.
    """

    steps: int
    """The spacing of the milestones, in steps (1 or more)."""
    exact: bool = True
    """True: every step divisible by ``steps``; False: each checkpoint at least ``steps``
    steps after the last one kept."""

    def __post_init__(self) -> None:
        _check_count("KeepEvery steps", self.steps, minimum=1)
        if not isinstance(self.exact, bool):
            raise TypeError(f"KeepEvery exact must be a bool, got {self.exact!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        if self.exact:
            return {c.step for c in checkpoints if c.step % self.steps == 0}
        out: set[int] = set()
        last: int | None = None
        for step in sorted({c.step for c in checkpoints}):
            if last is None or step - last >= self.steps:
                out.add(step)
                last = step
        return out

    def __repr__(self) -> str:
        return f"KeepEvery({self.steps})" if self.exact else f"KeepEvery({self.steps}, exact=False)"


@dataclass(frozen=True, repr=False)
class KeepInterval(RetentionPolicy):
    """Checkpoints at least ``seconds`` apart in commit time (Orbax's ``keep_time_interval``,
    ``EveryNSeconds``).

    Walking the checkpoints from the oldest commit to the newest (``committed_at``, then step),
    the first is kept, then each one committed at least ``seconds`` after the last one kept.
    Deleting checkpoints this policy does not keep never changes its answer, so a checkpoint
    kept once is kept at every later prune (as long as the ones it kept before are still there).

    Differences from Orbax that stay: Orbax walks in step order, this walks in commit order
    (the same unless an older step was committed later, ``allow_older_steps``); Orbax's times
    are its step directories' commit timestamps, these are the manifests' ``committed_at``.
    """

    seconds: float
    """The least commit time between two checkpoints kept, in seconds (finite, > 0)."""

    def __post_init__(self) -> None:
        s = self.seconds
        if not isinstance(s, (int, float)) or isinstance(s, bool):
            raise TypeError(f"KeepInterval seconds must be a number, got {type(s).__name__}")
        if not math.isfinite(s) or s <= 0:
            raise ValueError(f"KeepInterval seconds must be finite and > 0, got {s!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        out: set[int] = set()
        last: float | None = None
        for c in sorted(checkpoints, key=lambda c: (c.committed_at, c.step)):
            if last is None or c.committed_at - last >= self.seconds:
                out.add(c.step)
                last = c.committed_at
        return out

    def __repr__(self) -> str:
        return f"KeepInterval({self.seconds!r})"


@dataclass(frozen=True, repr=False)
class KeepSteps(RetentionPolicy):
    """Exactly the listed steps, when they exist (hand-picked checkpoints to keep)."""

    steps: frozenset[int]
    """The steps to keep, given as any iterable of ints."""

    def __init__(self, steps: Iterable[int]) -> None:
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise TypeError(f"KeepSteps takes an iterable of ints, got {steps!r}")
        values = [_check_count("KeepSteps step", s) for s in steps]
        object.__setattr__(self, "steps", frozenset(values))

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints if c.step in self.steps}

    def __repr__(self) -> str:
        return f"KeepSteps({sorted(self.steps)!r})"


@dataclass(frozen=True, repr=False)
class KeepAll(RetentionPolicy):
    """Everything: the behaviour of an engine with no ``keep=``."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints}

    def __repr__(self) -> str:
        return "KeepAll()"


# -- planning -----------------------------------------------------------------------------------


def _leaves(policy: RetentionPolicy) -> list[RetentionPolicy]:
    if isinstance(policy, Union):
        return [leaf for p in policy.policies for leaf in _leaves(p)]
    return [policy]


def metric_warnings(
    policy: RetentionPolicy | None, checkpoints: Sequence[CheckpointInfo]
) -> dict[str, str]:
    """One message per (policy, metric) whose metric some checkpoints lack: key -> message.

    The key (``"KeepBest(1, 'val_loss')/val_loss"``) lets a caller warn once per policy and
    metric however often it prunes; the message names the steps and the metrics that do exist.
    """
    if policy is None:
        return {}
    cps = sorted(checkpoints, key=lambda c: c.step)
    present = sorted({k for c in cps for k in c.metrics})
    out: dict[str, str] = {}
    for leaf in _leaves(policy):
        for metric in sorted(leaf.missing_metrics(cps)):
            key = f"{leaf!r}/{metric}"
            if key in out:
                continue
            lacking = [c.step for c in cps if metric not in c.metrics]
            shown = ", ".join(map(str, lacking[:10])) + (", ..." if len(lacking) > 10 else "")
            have = ", ".join(repr(m) for m in present) if present else "none"
            out[key] = (
                f"{leaf!r}: metric {metric!r} is missing from {len(lacking)} of {len(cps)} "
                f"checkpoint(s) (step(s) {shown}); this policy does not keep those, so it may "
                f"delete your best checkpoint. Metrics the checkpoints report: {have}. Pass "
                f"{metric!r} in save(metrics=...), fix the name, or use missing='keep'."
            )
    return out


@dataclass(frozen=True)
class PrunePlan:
    """``keep``: step -> reasons (protections first, then policies); ``delete``: ascending;
    ``warnings``: ``metric_warnings`` of the policy on the candidates (key -> message)."""

    keep: dict[int, list[str]]
    delete: list[int]
    warnings: dict[str, str] = field(default_factory=dict)


def protected_steps(
    checkpoints: Sequence[CheckpointInfo],
    *,
    tracker_step: int | None = None,
    resumed_from: int | None = None,
    pinned: Iterable[int] = (),
    in_use: Iterable[int] = (),
) -> dict[int, list[str]]:
    """Steps no policy may delete, with why: newest, tracker, resumed-from, protected, in-use.

    ``resumed_from`` should be passed only until a newer checkpoint of this run has committed
    (the caller knows; after that the newest one protects the run's progress).
    """
    present = {c.step for c in checkpoints}
    out: dict[int, list[str]] = {}

    def add(step: int | None, reason: str) -> None:
        if step is not None and step in present and reason not in out.get(step, []):
            out.setdefault(step, []).append(reason)

    add(max(present) if present else None, "newest")
    add(tracker_step, "tracker")
    add(resumed_from, "resumed-from")
    for s in sorted(set(pinned)):
        add(s, "protected")
    for s in sorted(set(in_use)):
        add(s, "in-use")
    return out


def plan_prune(
    checkpoints: Sequence[CheckpointInfo],
    policy: RetentionPolicy | None,
    *,
    tracker_step: int | None = None,
    resumed_from: int | None = None,
    pinned: Iterable[int] = (),
    in_use: Iterable[int] = (),
    run_id: str | None = None,
    scope: str = "all",
    committed_step: int | None = None,
) -> PrunePlan:
    """Decide what to keep and what to delete; the policy only ever sees deletion candidates.

    ``scope="all"`` makes every committed checkpoint a candidate; ``scope="run"`` only those whose
    ``run_id`` is this run's (slime's behaviour: a resumed or sibling run never deletes another
    run's checkpoints, which are kept with reason ``"other-run"``). ``policy=None`` keeps all.
    Raises ValueError on duplicate steps (the caller's scan is broken; deleting would be a guess).

    ``committed_step``: the step whose commit this prune follows (the engine's prune). It is
    kept (``"just-committed"``), and steps above it are no candidates either
    (``"above-just-committed"``): with ``allow_older_steps`` they are another timeline's (a
    stale run's ``global_step_1000`` while this run saves 10, 20, ...), which this run's policy
    neither deletes nor lets take the places of its own checkpoints. In a run whose steps only
    go forward the step just committed is the newest, and this changes nothing.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if scope == "run" and run_id is None:
        raise ValueError("scope='run' needs the run_id of this run")
    if policy is not None and not isinstance(policy, RetentionPolicy):
        raise TypeError(f"policy must be a RetentionPolicy or None, got {policy!r}")
    cps = sorted(checkpoints, key=lambda c: c.step)
    steps = [c.step for c in cps]
    if len(set(steps)) != len(steps):
        raise ValueError(f"duplicate steps among checkpoints: {steps}")

    keep = protected_steps(
        cps, tracker_step=tracker_step, resumed_from=resumed_from, pinned=pinned, in_use=in_use
    )
    if scope == "run":
        candidates = [c for c in cps if c.run_id == run_id]
        for c in cps:
            if c.run_id != run_id:
                keep.setdefault(c.step, []).append("other-run")
    else:
        candidates = cps
    if committed_step is not None:
        if committed_step in steps:
            keep.setdefault(committed_step, []).append("just-committed")
        for c in candidates:
            if c.step > committed_step:
                keep.setdefault(c.step, []).append("above-just-committed")
        candidates = [c for c in candidates if c.step <= committed_step]
    reasons = (policy or KeepAll()).explain(candidates)
    for step in {c.step for c in candidates}:
        if step in reasons:
            keep.setdefault(step, []).extend(reasons[step])
    delete = [s for s in steps if s not in keep]
    return PrunePlan(
        keep=dict(sorted(keep.items())),
        delete=delete,
        warnings=metric_warnings(policy, candidates),
    )


def should_prune(rank: int, local_rank: int, storage: str) -> bool:
    """Which rank prunes: on shared storage one deleter (global rank 0) is enough and two would
    race; on node-local storage every node has its own copy, so local rank 0 of each node."""
    _check_count("rank", rank)
    _check_count("local_rank", local_rank)
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    return rank == 0 if storage == "shared" else local_rank == 0


# -- save triggers ------------------------------------------------------------------------------


class SaveSchedule:
    """When to save: every ``every_steps`` steps, every ``every_seconds`` seconds, or whichever
    comes first when both are given; plus ``force=True`` and a one-shot preemption request.

    Semantics, chosen so a loop can call ``should_save(step)`` every step without bookkeeping:

    * the step trigger fires on ``step % every_steps == 0`` for ``step > 0`` (so saves land on
      round steps that ``KeepEvery`` milestones can align with, and a fresh run does not save its
      untrained step 0);
    * the time window starts at the first ``should_save`` call (not at construction: loading a
      checkpoint before training must not count) and restarts whenever ``should_save`` answers
      True or ``mark_saved`` is called -- answering True *is* the signal, no separate call needed;
    * asking again for the step that was just signalled answers False (unless forced or preempted),
      so a save is never signalled twice for one step;
    * after ``request_preemption_save()`` (the engine calls it on SIGTERM) the
      next ``should_save`` answers True exactly once, whatever the step.

    ``clock`` is injectable for tests. A schedule is meant for one training thread; the
    preemption request is safe to make from a signal handler or another thread.
    """

    def __init__(
        self,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_steps is not None:
            _check_count("every_steps", every_steps, minimum=1)
        if every_seconds is not None:
            if not isinstance(every_seconds, (int, float)) or isinstance(every_seconds, bool):
                raise TypeError(f"every_seconds must be a number, got {every_seconds!r}")
            if not math.isfinite(every_seconds) or every_seconds <= 0:
                raise ValueError(f"every_seconds must be finite and > 0, got {every_seconds!r}")
        if not callable(clock):
            raise TypeError("clock must be callable")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._clock = clock
        self._window_start: float | None = None
        self._last_step: int | None = None
        # Counters, not a flag + lock: a signal handler may run between any two bytecodes of
        # should_save, and incrementing one counter never loses a request that way.
        self._requests = 0
        self._answered = 0

    def __repr__(self) -> str:
        return (
            f"SaveSchedule(every_steps={self.every_steps!r}, every_seconds={self.every_seconds!r})"
        )

    @property
    def preemption_requested(self) -> bool:
        """True while a preemption save has been requested and not yet signalled."""
        return self._requests > self._answered

    def request_preemption_save(self) -> None:
        """Make the next ``should_save`` answer True once (safe from signal handlers)."""
        self._requests += 1

    def mark_saved(self, step: int) -> None:
        """Record a save made without asking (e.g. a direct ``engine.save``): restarts the time
        window. It does not consume a pending preemption request."""
        self._last_step = step
        self._window_start = self._clock()

    def should_save(self, step: int, *, force: bool = False) -> bool:
        """Whether to save at ``step``; answering True restarts the time window."""
        now = self._clock()
        if self._window_start is None:
            self._window_start = now
        requests = self._requests
        preempt = requests > self._answered
        if preempt:
            self._answered = requests
        due = force or preempt
        if not due and step != self._last_step:
            if self.every_steps is not None and step > 0 and step % self.every_steps == 0:
                due = True
            elif self.every_seconds is not None and now - self._window_start >= self.every_seconds:
                due = True
        if due:
            self._last_step = step
            self._window_start = now
        return due
