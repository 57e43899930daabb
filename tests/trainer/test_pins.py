"""``engine.protect`` and a load's pin on their way to the worker (pins.py): whole messages
on the pipe, a reader thread that never waits for a prune, a pin always ended."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from asyncckpt import SyncCheckpointEngine
from asyncckpt.core import messages as M
from asyncckpt.testing import parts
from asyncckpt.trainer import pins
from asyncckpt.worker.pins import WorkerPins


def test_a_pin_waits_for_a_message_being_sent_by_another_thread(tmp_path, monkeypatch):
    """``sending()`` took no lock: a save sent in two writes (header, body) by the staging
    thread could have ``protect``'s message land between them, and the worker could not
    read the pipe any more. A pin is now sent only once the other sender is done."""
    real_send = M.send
    sent_by: list[str] = []

    def send(conn, data):
        sent_by.append(threading.current_thread().name)
        real_send(conn, data)

    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        engine.save(1, {"w": torch.zeros(4)}).committed_sync(60)
        supervisor = parts(engine).supervisor
        monkeypatch.setattr(M, "send", send)
        protecting = threading.Thread(target=engine.protect, args=(1,), name="protecting")
        with supervisor.sending():  # (as a save in the middle of its parts)
            protecting.start()
            time.sleep(0.5)
            assert "protecting" not in sent_by  # not sent in the middle of another message
        protecting.join(30)
        assert not protecting.is_alive() and sent_by == ["protecting"]


class _Events:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def test_the_worker_reader_never_waits_for_a_prune():
    """The reader thread applied a pin under the prunes' lock: during a long prune it
    stalled, and the arenas and drops behind the pin with it (a save's ``wait_mapped``, a
    budget's ``let_worker_go``). It hands the pin over and goes on; the answer comes once
    the prune is over."""
    worker_pins, events = WorkerPins(), _Events()
    with worker_pins.pruning():  # a prune running
        t0 = time.monotonic()
        worker_pins.submit(M.Protect(7), events)
        assert time.monotonic() - t0 < 0.5
        time.sleep(0.3)
        assert events.sent == []  # not before the prune is over
    deadline = time.monotonic() + 10
    while not events.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events.sent == [M.Protected(7)]
    with worker_pins.pruning() as kept:
        assert kept == (7,)
    worker_pins.submit(M.Protect(8, while_read=True), events)
    worker_pins.submit(M.Unprotect(8), events)
    deadline = time.monotonic() + 10
    while len(events.sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker_pins.kept() == (7,)


class _Link:
    def __init__(self) -> None:
        self.conn = object()
        self.unprotected: set[int] = set()


def _saver(reader: threading.Thread | None = None) -> pins.Pins:
    link = _Link()
    worker = SimpleNamespace(link=link, reader=reader, sending=contextlib.nullcontext)
    words = M.WordWait(threading.Condition(), lambda: worker.link, lambda: True)
    return pins.Pins(Path("."), 0, worker, words, lambda: True)  # type: ignore[arg-type]


def test_a_loads_pin_ends_even_when_the_worker_answered_late(monkeypatch):
    """The worker's word on a load's pin came after ``PROTECT_WAIT_S`` (a long prune): the
    load went on as if unpinned and never sent the end, but the pin did land: that worker
    never pruned the step again."""
    sent: list = []
    monkeypatch.setattr(M, "send", lambda conn, data: sent.append(data))
    monkeypatch.setattr(M, "encode", lambda msg: msg)
    monkeypatch.setattr(pins, "PROTECT_WAIT_S", 0.2)
    saver = _saver()
    with saver.kept_while_read(5):
        pass
    assert sent == [M.Protect(5, True), M.Unprotect(5)]


def test_protect_from_an_on_commit_callback_does_not_wait_for_its_own_thread(monkeypatch):
    """An ``on_commit`` callback runs on the thread that reads the worker's events, the one
    that would read the worker's answer: ``protect`` there waited ``PROTECT_WAIT_S`` (60 s)
    with every event of the worker unread meanwhile."""
    monkeypatch.setattr(M, "send", lambda conn, data: None)
    monkeypatch.setattr(M, "encode", lambda msg: msg)
    saver = _saver(reader=threading.current_thread())
    t0 = time.monotonic()
    assert saver.protect_in_worker(3) is saver.worker.link
    assert time.monotonic() - t0 < 1.0
