"""The blocking facade for training loops that are not async.

Same engine, same methods; waits block the calling thread instead of awaiting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from . import memory_tier
from .engine import CheckpointEngine, SaveHandle, _check_overlap, _check_tier


class SyncCheckpointEngine(CheckpointEngine):
    """``with SyncCheckpointEngine(root) as engine: engine.save(step, state)``."""

    def __enter__(self) -> SyncCheckpointEngine:
        self._core.start()
        self._core.install_sigterm()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()

    def close(self) -> None:
        """Wait for every staged save to commit, then stop the worker."""
        try:
            # Our SIGTERM handler stays on while draining: a preemption notice now still waits
            # for the staged saves (bounded), instead of killing the process mid-write.
            self._core.stop()
        finally:
            self._core.uninstall_sigterm()

    def save(  # type: ignore[override]
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        overlap: bool = False,
        tier: str = "disk",
    ) -> SaveHandle:
        core = self._core
        overlap = _check_overlap(overlap)  # before a slot is reserved
        tier = _check_tier(tier, overlap)
        core.wait_staged()  # one copy at a time: the previous overlapped save's first
        pending = core.begin_save(step, state, metrics, metadata)
        if tier == "memory":
            return memory_tier.save(core, pending)
        core.take_slot(pending)
        return core.finish_save(pending, overlap=overlap)

    def wait(self) -> None:  # type: ignore[override]
        self._core.drain()
        self._raise_pending()

    def prepare(self, state: Any) -> None:  # type: ignore[override]
        self._core.prepare(state)

    def load_latest(self, state: Any, *, strict: bool = True) -> int | None:  # type: ignore[override]
        return self._core.restorer.load_latest(state, strict)

    def load(  # type: ignore[override]
        self,
        state: Any,
        step: int | None = None,
        path: str | os.PathLike | None = None,
        *,
        strict: bool = True,
    ) -> int:
        return self._core.restorer.load(state, step=step, path=path, strict=strict)

    def resume(  # type: ignore[override]
        self,
        state: Any,
        mode: str = "latest",
        path: str | os.PathLike | None = None,
        *,
        strict: bool = True,
    ) -> int | None:
        return self._core.resume(state, mode, path, strict)
