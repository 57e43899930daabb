"""What a worker runs beside its write, and the worker as those services see it (typed).

After DCP's writer hooks and Megatron's ``finalize_fns``: the worker's loop writes, agrees and
commits; everything else it does (the memory hold, a hot resume's offer, replication, the
export, the pins) is a ``WorkerService`` whose hooks the loop calls at fixed points of a save,
in the order ``worker_main`` composed them. The services live in this wing and lower, below
the worker's own (``worker/``): so the worker they see is ``WorkerView``, a protocol the
``Worker`` satisfies structurally, and its start config is ``WorkerSettings``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from asyncckpt.cluster.dist import DistConfig
from asyncckpt.core.savejob import SaveJob, TensorSpec
from asyncckpt.io.io_threads import IoThreads
from asyncckpt.io.throttle import Pacer


class WorkerSettings(Protocol):
    """The fields of a worker's start config (``WorkerConfig``) that the services read. A
    dataclass: a recovery and a stand-in run on a copy with fields replaced."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def root(self) -> str: ...
    @property
    def layout(self) -> str: ...
    @property
    def fmt(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def parent_pid(self) -> int: ...
    @property
    def orphan_deadline_s(self) -> float: ...
    @property
    def hot_hold_s(self) -> float: ...
    @property
    def hot_hold_auto(self) -> bool: ...
    @property
    def dist(self) -> DistConfig | None: ...
    @property
    def replication(self) -> object | None: ...  # replication.ReplicaConfig


#: A worker's config, kept as its own type through a recovery's replacements.
Settings = TypeVar("Settings", bound=WorkerSettings)


@dataclass
class Written:
    """What a worker wrote last: the job (its arenas, its specs) and this rank's files."""

    job: SaveJob
    files: tuple[str, ...]


class WorkerView(Protocol):
    """The worker as its services use it: its config and root, the arenas the trainer sent,
    how it writes, and its save (the services write through it, never around it)."""

    @property
    def config(self) -> WorkerSettings: ...
    @property
    def root(self) -> Path: ...
    @property
    def arenas(self) -> dict[int, torch.Tensor]: ...
    @property
    def trainer_gone(self) -> bool: ...
    @property
    def last_written(self) -> Written | None: ...
    @property
    def io_threads(self) -> IoThreads: ...
    @property
    def pacer(self) -> Pacer | None: ...
    @property
    def direct_io(self) -> bool: ...

    def job_specs(self, job: SaveJob) -> list[TensorSpec]:
        """Where ``job``'s tensors lie in its arenas."""
        ...

    def save(self, job: SaveJob) -> None:
        """Write, agree and commit ``job`` as any save (its outcome goes to the trainer)."""
        ...


class WorkerService(Protocol):
    """A service a worker runs beside its write. Every hook has a default that does nothing:
    an implementation overrides those it needs. The loop calls each hook on every service,
    in order, at these points:

    ``on_message`` on the reader thread, each trainer message as it arrives (also while a save
    is written; True: handled here, not queued for the main loop); ``on_start`` once the
    trainer was told the worker is ready; ``on_job`` when the main loop takes a save;
    ``before_write`` once its temporary exists, before a byte is written; ``after_write`` once
    its files hold every byte (raising fails the save); ``released`` when its arenas are free
    (the trainer was told); ``manifest`` the fields its commit records; ``after_commit`` on the
    rank that committed (a failure's info fails the save, the step stays committed);
    ``failed`` when it did not commit; ``trainer_gone`` at the trainer's death, after every
    save it staged; ``close`` when the loop ended (``release_lock`` lets a new engine start).
    """

    def on_message(self, msg: object) -> bool:
        return False

    def on_start(self) -> None:
        return None

    def on_job(self, job: SaveJob) -> None:
        return None

    def before_write(self, job: SaveJob) -> None:
        return None

    def after_write(self, job: SaveJob) -> None:
        return None

    def released(self, job: SaveJob) -> None:
        return None

    def manifest(self, job: SaveJob) -> dict[str, Any]:
        return {}

    def after_commit(self, job: SaveJob, final: Path, stats: dict[str, Any]) -> dict | None:
        return None

    def failed(self, job: SaveJob, why: str) -> None:
        return None

    def trainer_gone(self) -> None:
        return None

    def close(self, release_lock: Callable[[], None]) -> None:
        return None
