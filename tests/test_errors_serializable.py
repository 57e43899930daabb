"""Errors as documented: a state entry that cannot be saved (a lambda, a lock, an object holding
one) raises ``NotSerializable`` from ``save``, both a ``CheckpointError`` and a ``TypeError``,
naming the entry's key path and its type, before anything is written; the exceptions page lists
every public exception with when it happens."""

from __future__ import annotations

import inspect
import os
import pickle
import re
import threading
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointEngine, CheckpointError, NotSerializable, SyncCheckpointEngine
from asyncckpt import errors as errors_module

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[1]


class HoldsALock:
    """An object of an importable class that does not pickle: it holds a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


#: (what, the entry, its key path, its type as the error names it)
BAD = [
    ("a lambda", {"fn": lambda x: x}, "extra.fn", "function"),
    ("a lock", {"guard": threading.Lock()}, "extra.guard", "_thread.lock"),
    ("an object holding a lock", {"obj": HoldsALock()}, "extra.obj", f"{__name__}.HoldsALock"),
]
#: (engine keywords, the format): DCP, and the one-file-per-rank Megatron format (pickled whole)
FORMATS = [
    pytest.param({}, id="dcp"),
    pytest.param({"layout": "megatron", "format": "megatron_legacy"}, id="megatron_legacy"),
]


def state_with(bad: dict) -> dict:
    return {"model": {"w": torch.arange(4.0)}, "extra": bad}


def nothing_written(root: Path) -> list[str]:
    """The checkpoint directories (committed or temporary) under ``root``: none expected."""
    return [n for n in os.listdir(root) if not n.startswith(".asyncckpt")]


def check(e: NotSerializable, key: str, type_name: str) -> None:
    assert isinstance(e, CheckpointError) and isinstance(e, TypeError)
    assert e.type_name == type_name and type_name in str(e)
    assert e.key == key and repr(key) in str(e)
    assert "nothing was written" in str(e)


@pytest.mark.parametrize("options", FORMATS)
def test_sync_save_of_an_unsaveable_entry(tmp_path, options):
    with SyncCheckpointEngine(tmp_path, **options) as engine:
        for what, bad, key, type_name in BAD:
            with pytest.raises(NotSerializable) as info:
                engine.save(1, state_with(bad))
            check(info.value, key, type_name)
            assert not nothing_written(tmp_path), (what, nothing_written(tmp_path))
        # The engine is unharmed: the same step saves once the entry is left out.
        engine.save(1, state_with({}))
        engine.wait()
    assert len(nothing_written(tmp_path)) >= 1


async def test_async_save_of_an_unsaveable_entry(tmp_path, anyio_backend):
    async with CheckpointEngine(tmp_path) as engine:
        for what, bad, key, type_name in BAD:
            with pytest.raises(NotSerializable) as info:
                await engine.save(1, state_with(bad))
            check(info.value, key, type_name)
            # Caught as what it also is, by callers that caught a TypeError before.
            with pytest.raises(TypeError):
                await engine.save(1, state_with(bad))
            with pytest.raises(CheckpointError):
                await engine.save(1, state_with(bad))
            assert not nothing_written(tmp_path), (what, nothing_written(tmp_path))
        await (await engine.save(1, state_with({}))).committed()


def test_not_serializable_pickles_with_its_key_and_type():
    e = pickle.loads(pickle.dumps(NotSerializable("m", "a.b", "function")))
    assert (str(e), e.key, e.type_name) == ("m", "a.b", "function")


def public_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class that ``asyncckpt`` exports or ``asyncckpt.errors`` defines."""
    found = {}
    for name in asyncckpt.__all__:
        obj = getattr(asyncckpt, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            found[name] = obj
    for name, obj in vars(errors_module).items():
        if inspect.isclass(obj) and issubclass(obj, BaseException) and not name.startswith("_"):
            if obj.__module__ == errors_module.__name__:
                found[name] = obj
    return found


def test_every_public_exception_is_a_checkpoint_error_listed_on_the_page():
    page = (REPO / "docs" / "reference" / "errors.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \| .+? \|", page, re.M))
    found = public_exceptions()
    assert {"CheckpointError", "NotSerializable", "SaveFailed"} <= set(found)
    for name, cls in found.items():
        assert issubclass(cls, CheckpointError), f"{name} does not derive from CheckpointError"
        assert name in rows, f"{name} has no row on the exceptions page"
        bases = set(re.findall(r"`(\w+)`", rows[name]))
        direct = {b.__name__ for b in cls.__bases__}
        assert direct <= bases, f"{name}: the page says {rows[name]}, its bases are {direct}"
        assert name in dir(asyncckpt), f"{name} is not importable from asyncckpt"
