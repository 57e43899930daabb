"""Test hooks: an engine's parts, for asyncckpt's own tests, benchmarks and users' crash tests.

``parts(engine)`` is the ``trainer.parts.EngineParts`` an engine (async or sync) is made of:
``.saver`` (saving.Saver: ``slots``, ``flatten_cache``), ``.jobs`` (jobs.JobTable: what is in
flight, ``fail``, ``pending_error``), ``.supervisor`` (supervisor.WorkerSupervisor: ``ready``,
``link``, ``restarts``, ``wait_ready``), ``.restorer``, ``.sigterm``, and ``drain``/``stop``.
These are internals: they change without deprecation. What a user needs (the worker's pid,
restarts, readiness and throttle, the last prune, the rank) is public on the engine itself.
"""

from __future__ import annotations

from asyncckpt.engine import EngineBase
from asyncckpt.trainer.parts import EngineParts

__all__ = ["parts", "wait_worker_ready"]


def parts(engine: EngineBase) -> EngineParts:
    """The parts of ``engine`` (a ``CheckpointEngine`` or a ``SyncCheckpointEngine``)."""
    if not isinstance(engine, EngineBase):
        raise TypeError(f"parts() needs a CheckpointEngine or SyncCheckpointEngine, got {engine!r}")
    return engine._engine


def wait_worker_ready(engine: EngineBase, timeout: float | None = None) -> bool:
    """Block until the engine's current worker reported ready (it starts in the background);
    False if ``timeout`` passed first."""
    return parts(engine).supervisor.ready.wait(timeout)
