"""What the trainer hands its worker for one save (``SaveJob``), in a module of its own: the
worker (worker/loop.py) runs it, and the replicas' wire codec (jobwire.py) builds one from what a
peer sent, below the worker that imports replication.py. ``TensorSpec`` says where each staged
tensor sits in the arenas (``staging.arenas`` lays them out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class TensorSpec:
    """Where one staged tensor's bytes sit: which arena of the slot, at what offset."""

    fqn: str
    arena: int  # index of the arena within the slot
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class SaveJob:
    job_id: int
    step: int
    arena_ids: list[int]
    specs: list[TensorSpec] | None  # None: those sent with the arenas ("specs" message)
    objects: dict[str, bytes]  # {fqn: torch.save bytes}, serialised by the trainer
    paths: dict[str, list] | None  # None: the previous job's
    metrics: dict[str, float]
    faults: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)  # save(metadata=...): the manifest's "metadata"
    prune: Any = None  # a prune request, run after the commit
    extra: Any = None  # the format's part of the job (formats.staged.Prepared.extra)
    attempt: int = 0  # how many earlier jobs this engine sent for the same step
    # The trainer's side of the save's figures (SaveStats: stage/wait/alloc seconds, staged
    # bytes), recorded in the manifest with the worker's own (manifest.build_manifest).
    figures: dict = field(default_factory=dict)
    saved_at: float | None = None  # unix time of the trainer's save() call (durable_within)
    # The memory tier (memory/tier.py): "memory" for a memory checkpoint being written, why,
    # and the memory save it writes (a persist the trainer asked for).
    tier: str = "disk"
    persisted_because: str | None = None
    memory_job_id: int | None = None
    # A disk save staged into a memory slot: the id of the memory job holding that slot, whose
    # release waits for this write (memory_hold.Holder.written).
    held_as: int | None = None
    # A state over Staging(max_host_bytes=): its chunk plan (chunked.ChunkedPlan); the bytes
    # arrive chunk by chunk in the one arena of arena_ids while the worker writes them.
    chunks: Any = None
    # Staged key -> xxh3-128 of its view's bytes, taken by the trainer (unchanged.py) while it
    # decided which copies to skip: the worker's file fingerprints use them instead of hashing
    # those bytes again. Digests of bytes, never an "unchanged" verdict (differential.py).
    digests: dict[str, bytes] | None = None
