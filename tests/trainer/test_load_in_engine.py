"""A load inside the running engine reads at disk speed: its pin does not wait for the worker's
start (a spawned interpreter importing torch, seconds), and no prune deletes the step it reads.

The worker's start is held here by its lock (a worker takes it before its loop, before its
``Ready``): the test takes it first, in the trainer, right before the worker is spawned."""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from asyncckpt import KeepLast, SyncCheckpointEngine
from asyncckpt.core import layout as L
from asyncckpt.core import messages as M
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.localfs import unlock
from asyncckpt.testing import parts
from asyncckpt.trainer import pins, restore, supervisor
from asyncckpt.worker.pins import WorkerPins


def steps_on_disk(root) -> list[int]:
    return sorted(
        s for n in os.listdir(root) if (s := L.parse_dir_name("global_step", n)) is not None
    )


class _WorkerGate:
    """Holds each new worker before its loop: its lock, taken here before it is spawned."""

    def __init__(self, root, monkeypatch) -> None:
        self.fd: int | None = None
        real = supervisor.WorkerSupervisor._spawn

        def spawn(sup: supervisor.WorkerSupervisor) -> None:
            self.fd = LocalStore(root).lock("worker0", wait=False)
            assert self.fd is not None
            real(sup)

        monkeypatch.setattr(supervisor.WorkerSupervisor, "_spawn", spawn)

    def open(self) -> None:
        if self.fd is not None:
            unlock(self.fd)
            self.fd = None


def _committed(root, step: int, value: float) -> dict:
    state = {"w": torch.full((1000,), value)}
    with SyncCheckpointEngine(root, keep=None) as engine:
        engine.save(step, state).committed_sync(60)
    return state


def test_a_load_inside_the_engine_does_not_wait_for_the_workers_start(
    tmp_path, monkeypatch, caplog
):
    """Inside ``with engine:`` a load waited for the worker's word on its pin, which a
    worker still importing gives only once started (a cold 1 GiB load: 3.8x a cold
    ``dcp.load``). No job was handed to that worker before the pin: every prune it will run
    comes with a later job, read after the pin, so the load need not wait."""
    state = _committed(tmp_path, 10, 10.0)
    monkeypatch.setattr(pins, "PROTECT_WAIT_S", 0.5)  # (the old wait gives up soon, loudly)
    gate = _WorkerGate(tmp_path, monkeypatch)
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        try:
            target = {"w": torch.zeros(1000)}
            assert engine.load_latest(target) == 10
            assert torch.equal(target["w"], state["w"])
            assert engine.load(target, step=10) == 10
            # Done while the worker is held before its loop: it has said nothing yet.
            assert not parts(engine).supervisor.ready.is_set()
            assert "did not confirm" not in caplog.text
        finally:
            gate.open()
        # The pins went with the loads (in order, once the worker started): step 10 goes.
        engine.save(20, {"w": torch.full((1000,), 20.0)}).committed_sync(60)
        deadline = time.monotonic() + 30  # (the prune follows the commit)
        while steps_on_disk(tmp_path) != [20] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert steps_on_disk(tmp_path) == [20]


def test_a_step_loaded_before_the_worker_started_is_not_pruned_under_the_load(
    tmp_path, monkeypatch
):
    """Invariant 3 with a pin sent without the worker's word: step 10 is read (held in the
    middle of its read) while save 20 commits with ``KeepLast(1)`` and its prune runs; the
    load restores step 10 whole, and step 10 goes only at the next prune after the load."""
    state = _committed(tmp_path, 10, 10.0)
    gate = _WorkerGate(tmp_path, monkeypatch)
    read = restore.Restorer.load_dir.__wrapped__  # (the read itself, below the pin)
    reading, pruned = threading.Event(), threading.Event()

    def held_read(self, *args, **kwargs):
        reading.set()
        assert pruned.wait(120)
        return read(self, *args, **kwargs)

    monkeypatch.setattr(restore.Restorer, "load_dir", restore._kept_while_read(held_read))
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        target = {"w": torch.zeros(1000)}
        got: list = []
        loader = threading.Thread(target=lambda: got.append(engine.load(target, step=10)))
        try:
            loader.start()
            assert reading.wait(120)
        finally:
            gate.open()  # the worker starts now, with the load's pin first in its pipe
        try:
            engine.save(20, {"w": torch.full((1000,), 20.0)}).committed_sync(60)
            deadline = time.monotonic() + 60
            while engine.last_prune is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.last_prune is not None  # save 20's prune ran
            assert steps_on_disk(tmp_path) == [10, 20]  # ... and kept the step being read
        finally:
            pruned.set()
            loader.join(120)
        assert got == [10] and torch.equal(target["w"], state["w"])
        monkeypatch.undo()
        engine.save(30, state).committed_sync(60)  # the pin went with the load
        deadline = time.monotonic() + 30
        while steps_on_disk(tmp_path) != [30] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert steps_on_disk(tmp_path) == [30]


class _Events:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def test_a_pin_read_by_the_worker_counts_before_its_thread_applies_it(monkeypatch):
    """The worker's reader hands a pin to a thread of its own; a job read right after it
    could be written and pruned before that thread ran (the trainer no longer waits for the
    word when no job went first). A pin counts for every prune from the moment it is read."""
    worker_pins, events = WorkerPins(), _Events()
    go = threading.Event()
    real_on = worker_pins.on

    def slow_on(msg):
        assert go.wait(60)
        real_on(msg)

    monkeypatch.setattr(worker_pins, "on", slow_on)
    worker_pins.submit(M.Protect(9, while_read=True), events)
    with worker_pins.pruning() as kept:  # a prune of a job read after the pin
        assert kept == (9,)
    worker_pins.submit(M.Unprotect(9), events)
    go.set()
    deadline = time.monotonic() + 30
    while worker_pins.kept() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker_pins.kept() == () and events.sent == [M.Protected(9)]
