"""The blocking facade for training loops that are not async.

Same engine, same options (``EngineBase``); the methods that wait block the calling thread
instead of awaiting. ``save`` runs the very steps the async facade runs
(``Saver.save_steps``), in place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from typing_extensions import Unpack

from asyncckpt.engine import EngineBase, SaveHandle
from asyncckpt.trainer.parts import left_by
from asyncckpt.trainer.saving import SaveOptions
from asyncckpt.trainer.steps import run_steps


class SyncCheckpointEngine(EngineBase):
    """``with SyncCheckpointEngine(root) as engine: engine.save(step, state)``."""

    def __enter__(self) -> SyncCheckpointEngine:
        self._engine.start()
        self._engine.sigterm.install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A failed save is raised only when the block ended normally: else the user's own
        # exception goes on and the failure is logged.
        self._close(raise_failure=exc_type is None, why=left_by(exc_type))

    def close(self) -> None:
        """Wait for every staged save to commit, then stop the worker; raise the first save
        that failed unseen (``SaveFailed``: not on its handle, not by ``wait()`` or a save)."""
        self._close(raise_failure=True)

    def _close(self, *, raise_failure: bool, why: str = "") -> None:
        try:
            # Our SIGTERM handler stays on while draining: a preemption notice now still waits
            # for the staged saves (bounded), instead of killing the process mid-write.
            self._engine.close(raise_failure=raise_failure, why=why)
        finally:
            self._engine.sigterm.uninstall()

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        metadata: dict[str, Any] | None = None,
        **options: Unpack[SaveOptions],
    ) -> SaveHandle:
        """Stage ``state`` and return once it is safe to mutate (see ``CheckpointEngine.save``)."""
        return run_steps(self._engine.saver.save_steps(step, state, metrics, metadata, **options))

    def wait(self) -> None:
        """Block until everything in flight has committed; raise if a save failed."""
        self._engine.drain()
        self._engine.raise_pending_error()

    def prepare(self, state: Any) -> None:
        """Allocate the staging arenas now, so the first save stalls no longer than later ones."""
        self._engine.saver.prepare(state)

    def load_latest(self, state: Any, *, strict: bool = True) -> int | None:
        """See ``CheckpointEngine.load_latest``."""
        return self._engine.restorer.load_latest(state, strict)

    def load(
        self,
        state: Any,
        step: int | None = None,
        path: str | os.PathLike | None = None,
        *,
        strict: bool = True,
    ) -> int:
        """See ``CheckpointEngine.load``."""
        return self._engine.restorer.load(state, step=step, path=path, strict=strict)

    def resume(
        self,
        state: Any,
        mode: str = "latest",
        path: str | os.PathLike | None = None,
        *,
        strict: bool = True,
    ) -> int | None:
        """SkyRL's resume modes: "latest", "from_path" (needs ``path``) or "none"."""
        return self._engine.resume(state, mode, path, strict)
