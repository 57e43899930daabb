"""``PauseHooks``: an optimizer's step hooks that hold the background write while it steps
(``engine.pause_writes_during``)."""

from __future__ import annotations

from typing import Any

from asyncckpt.io.throttle import WritePause


class PauseHooks:
    """Step pre/post hooks on an optimizer that open and close a ``pause_writes`` region."""

    def __init__(self, pause: WritePause, optimizer: Any) -> None:
        self._pause = pause
        self._open = False
        self._handles = [
            optimizer.register_step_pre_hook(self._enter),
            optimizer.register_step_post_hook(self._exit),
        ]

    def _enter(self, *_: Any) -> None:
        if self._open:  # the previous step raised before its post hook: close that region
            self._pause.exit()
        self._pause.enter()
        self._open = True

    def _exit(self, *_: Any) -> None:
        if self._open:
            self._open = False
            self._pause.exit()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._exit()
