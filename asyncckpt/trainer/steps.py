"""How the facades run the engine's blocking work: a save's steps (``Saver.save_steps``) in
place (sync) or each in a worker thread (async), and a load in a worker thread."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import anyio

from asyncckpt.trainer.restore import deferring_warnings

T = TypeVar("T")


def run_steps(steps: Generator[Callable[[], Any], None, T]) -> T:
    """Run a ``Saver.save_steps``-like generator in place (the sync facade)."""
    try:
        call = next(steps)
        while True:
            try:
                call()
            except BaseException as e:  # (KeyboardInterrupt): the steps undo what they hold
                steps.throw(e)
                raise
            call = steps.send(None)
    except StopIteration as done:
        return done.value


async def run_steps_async(steps: Generator[Callable[[], Any], None, T]) -> T:
    """The same, each blocking call in a worker thread (the async facade)."""
    try:
        call = next(steps)
        while True:
            try:
                await anyio.to_thread.run_sync(call)
            except BaseException as e:  # cancelled: the steps undo what they hold
                steps.throw(e)
                raise
            call = steps.send(None)
    except StopIteration as done:
        return done.value


async def load_in_thread(fn: Callable[[], T]) -> T:
    """``fn`` (a load) in a worker thread; its warnings are re-emitted here, where
    ``stacklevel`` reaches the awaiting caller's line (from the thread it named anyio's code)."""
    caught: list[str] = []
    try:
        return await anyio.to_thread.run_sync(deferring_warnings(fn, caught))
    finally:
        for msg in caught:
            # 1: here, 2: the facade's method, 3: the user's await.
            warnings.warn(msg, stacklevel=3)
