"""The engine's options, grouped: one small frozen object per behaviour that has several knobs.

``CheckpointEngine(root, keep=KeepLast(3))`` stays a one-liner; a behaviour with more than one
knob is one object: ``schedule=Schedule(every_steps=100)``, ``retention=Retention(...)``,
``distributed=Distributed(...)``, ``preemption=Preemption(...)``, ``object_store=ObjectStore(...)``,
``memory=MemoryTier(...)``, ``staging=Staging(...)`` and ``throttle=ThrottleConfig...``
(the throttle). The flat keywords these replaced still work for
one release, with a ``DeprecationWarning`` naming the replacement (``resolve_options``).

Each object checks its own fields when made (a wrong type is refused there, not at the first
save). They are frozen dataclasses so a new knob is one more field (e.g. a memory tier's
schedule on ``Schedule``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from asyncckpt.io.throttle import ThrottleConfig, check_durable_within
from asyncckpt.retention import SCOPES as PRUNE_SCOPES
from asyncckpt.retention import STORAGES, RetentionPolicy, SaveSchedule

#: How long the checkpoint a run resumed from is protected from pruning (``keep_resumed=``).
KEEP_RESUMED = ("until_newer", "run")


def _number(name: str, value: Any, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0{' or None' if allow_none else ''}, "
                         f"got {value!r}")  # fmt: skip


def _optional_int(name: str, value: Any, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < minimum):  # fmt: skip
        raise ValueError(f"{name} must be an int >= {minimum} or None, got {value!r}")


@dataclass(frozen=True)
class Schedule:
    """When ``should_save`` answers yes: every ``every_steps`` steps, every ``every_seconds``
    seconds, or whichever comes first; with ``mtbf``, at the intervals the engine chooses
    from what it measures."""

    every_steps: int | None = None
    """Save every this many steps (None: not by steps)."""
    every_seconds: float | None = None
    """Save every this many seconds of wall time (None: not by time)."""
    memory_every_steps: int | None = None
    """``engine.due(step)`` answers ``"memory"`` every this many steps: a save to the
    memory tier (None: never)."""
    mtbf: float | None = None
    """The mean time between failures, in seconds: the engine then chooses ``every_steps``
    and ``memory_every_steps`` itself (Young/Daly, from the step time and the saves' cost it
    measures), starting from the ones given here until it has measured them (None: it
    does not)."""

    def __post_init__(self) -> None:
        self.make()  # SaveSchedule checks the fields (types and ranges)
        # (Not memory_tier's check: that module imports torch, and `import asyncckpt` must not.)
        _optional_int("memory_every_steps", self.memory_every_steps, 1)
        _number("mtbf", self.mtbf)

    def make(self) -> SaveSchedule:
        """The stateful trigger an engine asks (one per engine)."""
        return SaveSchedule(self.every_steps, self.every_seconds)


@dataclass(frozen=True)
class Retention:
    """How ``keep=`` is applied. ``scope``: ``"all"`` committed checkpoints are candidates, or
    only those this ``"run"`` wrote. ``keep_resumed``: the checkpoint this engine resumed from
    is protected ``"until_newer"`` commits (default), or for the whole ``"run"`` (Lightning's
    habit: the starting point survives ``KeepLast(1)``). ``allow_older_steps``: write a step
    below the newest one anyway (resuming an older run beside a newer one's checkpoints)."""

    scope: str = "all"
    """Which checkpoints ``keep=`` may delete: ``"all"`` committed ones, or only those this
    ``"run"`` wrote."""
    keep_resumed: str = "until_newer"
    """How long the checkpoint this engine resumed from is protected from pruning:
    ``"until_newer"`` checkpoints commit, or the whole ``"run"``."""
    allow_older_steps: bool = False
    """Accept a step lower than the newest committed or in-flight one (the tracker keeps
    naming the newest); by default such a step is refused before anything is written."""

    def __post_init__(self) -> None:
        if not isinstance(self.allow_older_steps, bool):
            raise TypeError(
                f"allow_older_steps must be True or False, got {self.allow_older_steps!r}"
            )
        if self.scope not in PRUNE_SCOPES:
            raise ValueError(f"retention scope must be one of {PRUNE_SCOPES}, got {self.scope!r}")
        if self.keep_resumed not in KEEP_RESUMED:
            raise ValueError(
                f"keep_resumed must be one of {KEEP_RESUMED}, got {self.keep_resumed!r}"
            )


@dataclass(frozen=True)
class Distributed:
    """Several ranks on one root. Every field defaults to what torch.distributed (or
    torchrun's environment) says; several nodes may be simulated on one machine."""

    rank: int | None = None
    """This rank (None: torch.distributed's, else 0)."""
    world_size: int | None = None
    """How many ranks save together (None: torch.distributed's, else 1)."""
    local_rank: int | None = None
    """This rank's index on its node (None: ``$LOCAL_RANK``, else the rank)."""
    node_rank: int | None = None
    """Which node this rank is on (None: torchrun's ``$GROUP_RANK``, else 0)."""
    ranks_per_node: int | None = None
    """How many ranks each node runs (None: torchrun's ``$LOCAL_WORLD_SIZE``, else every
    rank on one node)."""
    store: tuple[str, int] | None = None
    """``(host, port)`` where rank 0 hosts the workers' side store when no process group is
    initialised (None: found through the process group)."""
    timeout: float = 600.0
    """How long, in seconds, the workers wait for each other in each save."""
    storage: str = "shared"
    """``"shared"``: one root every rank sees (rank 0 prunes); ``"local"``: each node's own
    disk (each node's local rank 0 prunes)."""
    legacy_ranks: Any = None
    """The ``megatron_legacy`` format's tensor- and pipeline-parallel ranks (a
    ``LegacyRanks`` or a dict of its fields; None: Megatron's ``parallel_state`` if
    initialised, else one directory per rank)."""

    def __post_init__(self) -> None:
        _optional_int("rank", self.rank, 0)
        _optional_int("world_size", self.world_size, 1)
        _optional_int("local_rank", self.local_rank, 0)
        _optional_int("node_rank", self.node_rank, 0)
        _optional_int("ranks_per_node", self.ranks_per_node, 1)
        if self.store is not None and not (
            isinstance(self.store, tuple) and len(self.store) == 2
            and isinstance(self.store[0], str) and isinstance(self.store[1], int)
        ):  # fmt: skip
            raise TypeError(f"store must be a (host, port) tuple, got {self.store!r}")
        _number("timeout", self.timeout, allow_none=False)
        if self.storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {self.storage!r}")


@dataclass(frozen=True)
class Preemption:
    """A scheduler's preemption notice. ``handle_sigterm``: on SIGTERM, drain the staged saves
    and ask the schedule for one last save; ``final_save``: then let the loop make that save
    (``engine.preempted``) instead of terminating as SIGTERM would."""

    handle_sigterm: bool = True
    """On SIGTERM, drain the staged saves and ask the schedule for one last save."""
    final_save: bool = False
    """Then let the loop make that save (``engine.preempted`` says when) instead of
    terminating as SIGTERM would."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")


@dataclass(frozen=True)
class ObjectStore:
    """How a URL root (``s3://bucket/run``) is reached: ``storage_options`` for fsspec
    (endpoint, credentials), ``spool``: the local directory where steps are written and
    committed before upload (default: ``$ASYNCCKPT_SPOOL`` or the temp dir).
    ``max_queued_uploads``: committed steps that may wait in the spool for their upload (the
    one uploading included) while the next saves are written; at that many, the next save
    waits for room (said in the log). They cost local disk (one checkpoint each), no memory."""

    storage_options: Mapping[str, Any] | None = None
    """Passed to fsspec for the URL's filesystem: the endpoint, credentials, region (None:
    fsspec's defaults and the environment's credentials)."""
    spool: str | os.PathLike | None = None
    """The local directory where steps are written and committed before their upload (None:
    ``$ASYNCCKPT_SPOOL``, else the temporary directory)."""
    max_queued_uploads: int = 2
    """Committed steps that may wait in the spool for their upload (the one uploading
    included) while the next saves are written; at that many, the next save waits for room
    (said in the log). They cost local disk (one checkpoint each), no memory."""

    def __post_init__(self) -> None:
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict, got {self.storage_options!r}")
        if self.spool is not None and not isinstance(self.spool, (str, os.PathLike)):
            raise TypeError(f"spool must be a path, got {self.spool!r}")
        if type(self.max_queued_uploads) is not int or self.max_queued_uploads < 1:
            raise ValueError(
                f"max_queued_uploads must be an int >= 1, got {self.max_queued_uploads!r}"
            )


@dataclass(frozen=True)
class MemoryTier:
    """The memory tier: ``save(step, state, tier="memory")`` keeps the step in the worker's
    memory; its schedule is ``Schedule(memory_every_steps=)``."""

    persist_on_close: bool = False
    """Leaving the engine writes the newest memory save to disk as well (by default only a
    trainer's death or SIGTERM does)."""
    replicas: int = 0
    """0, or 1 to have each memory save sent by the worker to the worker of the same local
    rank on the next node, which holds it (a whole node's loss then keeps the newest memory
    step). Needs several nodes: a shared root, or node-local roots with
    ``Distributed(storage="local")``, where a replacement node fetches its replica at
    load."""
    hold_seconds: float | None = None
    """When the trainer dies, its worker (once it has committed what it was writing) keeps
    the newest step it wrote in its shared memory this long, so that a new engine on the same
    root, node and rank loads it from there (a hot resume: checked against the manifest's
    checksums, else read from disk; ``last_load_report.source`` says which); freed as soon as
    a new engine took it. None: 30 s, only for a memory save the worker persisted after the
    death and only where the node has room for a new trainer's staging beside it (said in the
    log when not). 0: the worker exits at once."""

    def __post_init__(self) -> None:
        if type(self.replicas) is not int or self.replicas not in (0, 1):
            raise ValueError(f"replicas must be 0 or 1, got {self.replicas!r}")
        if not isinstance(self.persist_on_close, bool):
            raise TypeError(
                f"persist_on_close must be True or False, got {self.persist_on_close!r}"
            )
        hold = self.hold_seconds
        if hold is not None and (
            isinstance(hold, bool) or not isinstance(hold, (int, float)) or not hold >= 0
        ):
            raise ValueError(f"hold_seconds must be a number >= 0 or None, got {hold!r}")


#: The smallest ``Staging(max_host_bytes=)``: a page (chunked.py checks its buffers fit).
MIN_HOST_BYTES = 4096


@dataclass(frozen=True)
class Staging:
    """The host memory ``save`` stages into, and how many saves it holds."""

    max_host_bytes: int | None = None
    """The most host memory the disk saves' staging buffers may take, together (all
    ``max_in_flight`` copies); None: no cap beyond what the machine has. At least 4096 bytes
    (a page).

    A state whose staging would exceed it is staged in chunks through the budget: two
    buffers of about half of it, the worker writing one chunk while ``save`` copies the next;
    ``save`` returns once the last chunk is copied (one snapshot: its stall grows with state /
    budget), and nothing is committed unless every chunk was written. Where chunks cannot be
    used (``overlap=True``, ``max_in_flight`` > 1, a memory-tier save, the megatron format,
    DTensors, a row of a tensor larger than a chunk) such a state is refused with
    ``StagingMemoryError`` before anything is written, never left to the OOM killer. The
    memory tier's own copies (``MemoryTier``) are not counted here, and once it is on a disk
    save is written from one of them (two copies serve both tiers), so this budget bounds
    nothing then."""
    max_in_flight: int = 1
    """Saves written at once; each holds one copy of the state in shared (pinned, on a GPU
    machine) host memory until its shards are written, and a save beyond them waits for the
    oldest to be written (back-pressure, reported as ``SaveStats.wait_seconds``)."""
    differential: bool = True
    """A shard file whose bytes would be the previous checkpoint's (fingerprinted with
    xxh3-128 from the staged bytes, never from version counters) is a hard link to that file
    instead of written again; every checkpoint stays whole (pruning the older one unlinks a
    name, not the bytes). DCP and megatron's ``torch_dist`` (its shards are DCP files); the
    one-file formats (``megatron_legacy``, ``pt``) write every file (a log line says so). A
    file is read and checked against its checksum before it is linked. It also spares the
    copy: a tensor of 1 MiB or more whose bytes the staging buffer already holds
    (fingerprinted where the tensor lives) is not copied again."""

    def __post_init__(self) -> None:
        # Below a page there is no room for chunked staging's two buffers and header.
        _optional_int("max_host_bytes", self.max_host_bytes, MIN_HOST_BYTES)
        if not isinstance(self.differential, bool):
            raise TypeError(f"differential must be True or False, got {self.differential!r}")
        if type(self.max_in_flight) is not int or self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {self.max_in_flight!r}")


@dataclass(frozen=True)
class EngineOptions:
    """Everything an engine was configured with, checked and grouped (``resolve_options``)."""

    layout: str = "global_step"
    format: str | None = None
    keep: RetentionPolicy | None = None
    throttle: ThrottleConfig | None = None
    on_commit: Callable[[Any], None] | None = None
    verify_on_load: bool = True
    schedule: Schedule = Schedule()
    retention: Retention = Retention()
    distributed: Distributed = Distributed()
    preemption: Preemption = Preemption()
    components: Mapping[str, Any] | None = None
    remote: Any = None  # storage.RemoteTier
    object_store: ObjectStore = ObjectStore()
    export: Any = None  # export.HFExport
    memory: MemoryTier = MemoryTier()
    staging: Staging = Staging()

    @property
    def write_timeout(self) -> float | None:
        return self.throttle.write_timeout if self.throttle is not None else None


#: Flat keywords of before the grouping -> (the group's keyword, its field, how to say it).
DEPRECATED = {
    "save_every_steps": ("schedule", "every_steps", "schedule=Schedule(every_steps=...)"),
    "save_every_seconds": ("schedule", "every_seconds", "schedule=Schedule(every_seconds=...)"),
    "prune_scope": ("retention", "scope", "retention=Retention(scope=...)"),
    "keep_resumed": ("retention", "keep_resumed", "retention=Retention(keep_resumed=...)"),
    "rank": ("distributed", "rank", "distributed=Distributed(rank=...)"),
    "world_size": ("distributed", "world_size", "distributed=Distributed(world_size=...)"),
    "local_rank": ("distributed", "local_rank", "distributed=Distributed(local_rank=...)"),
    "store": ("distributed", "store", "distributed=Distributed(store=...)"),
    "dist_timeout": ("distributed", "timeout", "distributed=Distributed(timeout=...)"),
    "storage": ("distributed", "storage", "distributed=Distributed(storage=...)"),
    "legacy_ranks": ("distributed", "legacy_ranks", "distributed=Distributed(legacy_ranks=...)"),
    "handle_sigterm": ("preemption", "handle_sigterm", "preemption=Preemption(handle_sigterm=...)"),
    "preemption_save": ("preemption", "final_save", "preemption=Preemption(final_save=True)"),
    "storage_options": (
        "object_store",
        "storage_options",
        "object_store=ObjectStore(storage_options=...)",
    ),  # fmt: skip
    "spool": ("object_store", "spool", "object_store=ObjectStore(spool=...)"),
    "persist_memory_on_close": (
        "memory",
        "persist_on_close",
        "memory=MemoryTier(persist_on_close=...)",
    ),  # fmt: skip
    "max_in_flight": ("staging", "max_in_flight", "staging=Staging(max_in_flight=...)"),
    "allow_older_steps": (
        "retention",
        "allow_older_steps",
        "retention=Retention(allow_older_steps=...)",
    ),  # fmt: skip
    "write_timeout": ("throttle", None, "throttle=ThrottleConfig.background(write_timeout=...)"),
    "optimizer_offload": ("throttle", None, "throttle=ThrottleConfig.for_optimizer_offload()"),
    "durable_within": ("throttle", None, "throttle=ThrottleConfig.background(durable_within=...)"),
}

_GROUPS = {
    "schedule": Schedule,
    "retention": Retention,
    "distributed": Distributed,
    "preemption": Preemption,
    "object_store": ObjectStore,
    "memory": MemoryTier,
    "staging": Staging,
}


def resolve_options(grouped: dict[str, Any], flat: dict[str, Any]) -> EngineOptions:
    """``grouped``: the engine's keywords; ``flat``: deprecated ones (each warns, naming its
    replacement). A flat keyword next to its group's object is refused: which would win?"""
    for name, value in grouped.items():
        kind = _GROUPS.get(name)
        if kind is not None and value is not None and not isinstance(value, kind):
            raise TypeError(f"{name}= takes {kind.__name__}(...), not {value!r}")
    unknown = set(flat) - set(DEPRECATED)
    if unknown:
        raise TypeError(f"CheckpointEngine got unexpected keyword argument(s) {sorted(unknown)}")
    changes: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        group, field_name, replacement = DEPRECATED[name]
        warnings.warn(
            f"CheckpointEngine({name}=...) is deprecated: pass {replacement}",
            DeprecationWarning,
            stacklevel=3,  # here, the engine's __init__, the caller
        )
        if grouped.get(group) is not None:
            raise TypeError(f"pass {name}= or {group}=, not both (use {replacement})")
        if field_name is not None:
            changes.setdefault(group, {})[field_name] = value
    for group, values in changes.items():
        grouped[group] = _GROUPS[group](**values)
    grouped["throttle"] = _throttle(grouped.get("throttle"), flat)
    for group, kind in _GROUPS.items():
        if grouped.get(group) is None:
            grouped[group] = kind()
    return EngineOptions(**grouped)


def _throttle(throttle: Any, flat: dict[str, Any]) -> ThrottleConfig:
    offload, durable = flat.get("optimizer_offload", False), flat.get("durable_within")
    if throttle is not None and not isinstance(throttle, ThrottleConfig):
        raise TypeError(
            f"throttle must be a ThrottleConfig (e.g. ThrottleConfig.background()), not "
            f"{throttle!r}"
        )
    if not isinstance(offload, bool):
        raise TypeError(f"optimizer_offload must be True or False, got {offload!r}")
    check_durable_within(durable)
    if throttle is None:  # an explicit config wins over the preset optimizer_offload names
        throttle = (
            ThrottleConfig.for_optimizer_offload() if offload else ThrottleConfig.background()
        )
    if durable is not None:
        throttle = dataclasses.replace(throttle, durable_within=durable)
    if "write_timeout" in flat:
        throttle = dataclasses.replace(throttle, write_timeout=flat["write_timeout"])
    return throttle
