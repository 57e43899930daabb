"""What a worker is started with (``WorkerConfig``) and what it prunes with (``PruneRequest``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncckpt.cluster.dist import DistConfig
from asyncckpt.core import layout as _layout
from asyncckpt.formats.differential import KeepRule
from asyncckpt.io.throttle import ThrottleConfig
from asyncckpt.memory.replication import ReplicaConfig
from asyncckpt.storage.prune import prune
from asyncckpt.storage.remote import RemoteTier
from asyncckpt.worker.export import HFExport


@dataclass
class WorkerConfig:
    root: str
    layout: str
    fmt: str
    rank: int = 0
    run_id: str = ""
    throttle: ThrottleConfig | None = None
    parent_pid: int = 0
    local_rank: int = 0  # which block of cores a throttle's cpu_cores count means
    dist: DistConfig | None = None  # when several ranks save together
    remote: RemoteTier | None = None  # publish every commit to an object store
    export: HFExport | None = None  # safetensors of a component every N steps
    # How long it may go on finishing staged saves after its trainer died (write_timeout).
    orphan_deadline_s: float = 600.0
    spool: bool = False  # root is a URL root's spool: record what was published in it
    # Rank 0 of several: the socket its trainer bound for the side store, served here so that
    # the commit's rendezvous outlives the trainer (dist.py).
    store_socket: Any = None
    # MemoryTier(replicas=1): whom this worker replicates its memory saves to and holds the
    # replicas of, or None.
    replication: ReplicaConfig | None = None
    # MemoryTier(hold_seconds=): how long to offer the newest step written to a new engine
    # once the trainer is gone (hot_serve.py); 0: exit at once.
    hot_hold_s: float = 0.0
    # MemoryTier() (no hold_seconds): hold only for a memory save persisted after the death,
    # where the node has room (hot_serve.HotServe.hold_seconds).
    hot_hold_auto: bool = False
    # Staging(differential=): link files unchanged since the last checkpoint (differential.py)
    differential: bool = False
    # What the prune after each commit keeps (every rank: only one prunes): a save links only
    # from a checkpoint that a kept step shares no file with (differential.link_source).
    keep: KeepRule | None = None
    # The trainer started without waiting for an earlier trainer's worker (one rank, a local
    # root: trainer/earlier_worker.py): this worker cleans the root's leftovers once it holds
    # the worker lock, before its first write.
    clean_root: bool = False


@dataclass(frozen=True)
class PruneRequest:
    """What the worker needs to prune after a commit (the policy is a picklable dataclass)."""

    policy: Any
    resumed_from: int | None = None
    pinned: tuple[int, ...] = ()
    run_id: str | None = None
    scope: str = "all"

    def run(self, root: Path, config: WorkerConfig, step: int, pinned: tuple[int, ...] = ()) -> Any:
        """``pinned``: steps protected after this request was made (pins.WorkerPins)."""
        # ``step`` is the checkpoint this worker has just committed, checksummed as it was
        # written: trusted, not read back at every save, and never pruned. (The tracker names
        # it only when steps go forward: with allow_older_steps it stays on a higher step.)
        # Warnings travel in the report; the engine shows them in the trainer's process.
        return prune(
            root,
            config.layout,
            self.policy,
            tracker_step=_layout.read_tracker(root),
            resumed_from=self.resumed_from,
            pinned=(*self.pinned, *pinned),
            run_id=self.run_id,
            scope=self.scope,
            trusted=(step,),
            warn=False,
            committed_step=step,
        )
