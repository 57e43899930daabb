"""A new user's first mistakes, each said in one clear line: a root with nothing to resume
warns naming its absolute path, a keyword typo in ``save()`` gets a did-you-mean, a full disk
reads its errno once, and a locked root names the process that holds it."""

from __future__ import annotations

import errno
import logging
import os
import socket
import warnings

import pytest
import torch

from asyncckpt import CheckpointEngine, RootLocked, SaveFailed, SyncCheckpointEngine, faults
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.localfs import unlock
from asyncckpt.trainer import supervisor
from asyncckpt.trainer.jobs import _rebuild_error
from asyncckpt.worker.report import error_info


def _state() -> dict:
    return {"w": torch.zeros(4)}


def _said(caplog: pytest.LogCaptureFixture, path: os.PathLike) -> list[logging.LogRecord]:
    """The records that name ``path`` (absolute) as having nothing to load."""
    where = str(os.path.abspath(path))
    return [r for r in caplog.records if where in r.getMessage() and "fresh" in r.getMessage()]


# ------------------------------------------------------ a root with nothing to resume


@pytest.mark.parametrize("made", [False, True], ids=["missing", "empty"])
def test_a_root_with_nothing_to_load_warns_once_naming_its_absolute_path(
    tmp_path, monkeypatch, caplog, made
):
    monkeypatch.chdir(tmp_path)
    if made:
        (tmp_path / "ckpts").mkdir()
    caplog.set_level(logging.DEBUG, logger="asyncckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one channel: the log, not a Python warning too
        assert SyncCheckpointEngine("ckpts").load_latest(_state()) is None
    (said,) = _said(caplog, tmp_path / "ckpts")
    assert said.levelno == logging.WARNING, said
    assert "\n" not in said.getMessage()


def test_a_mistyped_root_warns_inside_with_too(tmp_path, caplog):
    root = tmp_path / "ckpst"  # the engine's start makes it: empty, as a typo's would be
    caplog.set_level(logging.DEBUG, logger="asyncckpt")
    with SyncCheckpointEngine(root) as engine:
        assert engine.load_latest(_state()) is None
    (said,) = _said(caplog, root)
    assert said.levelno == logging.WARNING, said


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_async_engine_warns_before_and_inside_async_with(tmp_path, caplog, anyio_backend):
    caplog.set_level(logging.DEBUG, logger="asyncckpt")
    root = tmp_path / "never-made"
    assert await CheckpointEngine(root).load_latest(_state()) is None
    (said,) = _said(caplog, root)
    assert said.levelno == logging.WARNING
    caplog.clear()
    async with CheckpointEngine(root) as engine:
        assert await engine.load_latest(_state()) is None
    (said,) = _said(caplog, root)
    assert said.levelno == logging.WARNING


def test_a_root_holding_a_checkpoint_says_nothing_of_starting_fresh(tmp_path, caplog):
    root = tmp_path / "ckpts"
    with SyncCheckpointEngine(root) as engine:
        engine.save(1, _state())
    caplog.set_level(logging.DEBUG, logger="asyncckpt")
    assert SyncCheckpointEngine(root).load_latest(_state()) == 1
    assert not _said(caplog, root)


# ------------------------------------------------------ save()'s keyword typos


@pytest.mark.parametrize(
    "typo, meant", [("metric", "metrics"), ("meta_data", "metadata"), ("overlapp", "overlap")]
)
def test_a_keyword_typo_in_save_suggests_the_keyword_meant(tmp_path, typo, meant):
    engine = SyncCheckpointEngine(tmp_path / "r")  # checked before anything starts
    with pytest.raises(TypeError) as info:
        engine.save(1, _state(), **{typo: 1})
    msg = str(info.value)
    assert f"did you mean {meant!r}" in msg and "\n" not in msg, msg
    for keyword in ("metrics", "metadata", "overlap", "tier"):
        assert keyword in msg, msg
    assert not (tmp_path / "r").exists()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_async_save_suggests_metrics_too(tmp_path, anyio_backend):
    with pytest.raises(TypeError, match="did you mean 'metrics'"):
        await CheckpointEngine(tmp_path / "r").save(1, _state(), metric={"loss": 1.0})


# ------------------------------------------------------ a full disk


def test_an_oserror_from_the_worker_reads_its_errno_once():
    sent = error_info(OSError(errno.ENOSPC, "No space left on device", "/ckpt/x.distcp"))
    err = _rebuild_error(sent)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert str(err).count("[Errno 28]") == 1, str(err)
    assert "No space left on device" in str(err) and "/ckpt/x.distcp" in str(err)


def test_an_injected_enospc_reads_errno_28_once(tmp_path):
    faults.inject("mid_shard_write", "enospc")
    try:
        with pytest.raises(SaveFailed) as info:
            with SyncCheckpointEngine(tmp_path / "r") as engine:
                engine.save(1, _state())
                engine.wait()
    finally:
        faults.clear()
    for err in (info.value, info.value.__cause__):
        assert str(err).count("[Errno 28]") == 1, str(err)
    assert info.value.__cause__.errno == errno.ENOSPC


# ------------------------------------------------------ a locked root


def test_root_locked_names_the_holders_pid_and_host(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "LOCK_RETRY_S", 0.05)
    root = tmp_path / "r"
    fd = supervisor.lock_root(root, 0, None)  # as a running engine holds it
    try:
        with pytest.raises(RootLocked) as info:
            supervisor.lock_root(root, 0, None)
    finally:
        unlock(fd)
    msg = str(info.value)
    assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg, msg
    assert "since" in msg and "\n" not in msg, msg
    # Once let go, the next engine takes it.
    unlock(supervisor.lock_root(root, 0, None))


def test_the_pins_still_read_the_holders_pid_from_the_lock(tmp_path):
    from asyncckpt.storage import pinfile

    fd = LocalStore(tmp_path).lock("rank0", wait=False, note_pid=True)
    try:
        assert pinfile._holder_pid(tmp_path, 0) == os.getpid()
    finally:
        unlock(fd)
