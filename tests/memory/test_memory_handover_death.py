"""A memory save whose ``save()`` returned survives its trainer's death (invariant 12) at the
edges of the hand-over to the worker: the trainer killed while handing over the next memory
save, and a trainer whose forked child keeps the worker's pipes open after it died.

Each trainer is a subprocess killed with a real SIGKILL; its worker outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch
from test_flush_on_death import wait_gone

from asyncckpt import SyncCheckpointEngine
from asyncckpt.core import layout as L

# Memory save 3 is the first use of the second memory slot: its memory goes to the worker on
# the jobs pipe, its Hold on the memory pipe. The worker is descheduled (SIGSTOP, as on a
# busy node) from just before that memory is sent until 2 s later; the trainer is killed as
# soon as the Hold is on its pipe.
HANDOVER = r"""
import json, os, signal, subprocess, sys, torch
from asyncckpt import MemoryTier, SyncCheckpointEngine
import asyncckpt.core.messages as M
root = sys.argv[1]
engine = SyncCheckpointEngine(root, keep=None, memory=MemoryTier())
engine.__enter__()
state = {"w": torch.full((1 << 20,), 1.0)}
engine.save(1, state).committed_sync()
print(json.dumps({"worker": engine.worker_pid}), flush=True)
state["w"].fill_(2.0)
engine.save(2, state, tier="memory")  # the first slot: mapped before save() returns
print(json.dumps({"held": 2}), flush=True)
armed = {"on": False}
encode, send = M.encode, M.send
def encoding(msg):
    data = encode(msg)
    if isinstance(msg, M.Arena) and not armed["on"]:
        armed["on"] = True
        os.kill(engine.worker_pid, signal.SIGSTOP)
        subprocess.Popen(["sh", "-c", f"sleep 2; kill -CONT {engine.worker_pid}"])
    if isinstance(msg, M.Hold) and msg.job.step == 3:
        armed["hold"] = data
    return data
def sending(conn, data):
    send(conn, data)
    if armed.get("hold") is data:
        os.kill(os.getpid(), signal.SIGKILL)
M.encode, M.send = encoding, sending
state["w"].fill_(3.0)
engine.save(3, state, tier="memory")
print(json.dumps({"held": 3}), flush=True)
"""

# A process forked after the engine started (a logger, a data-loading process) outlives the
# trainer and holds the trainer's ends of the worker's pipes.
FORKED = r"""
import json, multiprocessing, os, signal, sys, time, torch
from asyncckpt import MemoryTier, SyncCheckpointEngine, ThrottleConfig
root = sys.argv[1]
engine = SyncCheckpointEngine(root, keep=None, memory=MemoryTier(),
                              throttle=ThrottleConfig.background(write_timeout=15))
engine.__enter__()
state = {"w": torch.full((1 << 16,), 1.0)}
engine.save(1, state).committed_sync()
state["w"].fill_(2.0)
engine.save(2, state, tier="memory")
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(45,))
child.start()
print(json.dumps({"worker": engine.worker_pid, "child": child.pid, "held": 2}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _run_killed(tmp_path, script: str) -> list[dict]:
    (tmp_path / "trainer.py").write_text(script)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run(
            [sys.executable, str(tmp_path / "trainer.py"), str(tmp_path / "r")],
            stdout=out,
            stderr=err,
            timeout=300,
        )
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "err").read_text()
    return [json.loads(x) for x in (tmp_path / "out").read_text().splitlines() if x.strip()]


def _resumed(root, n: int) -> tuple[int | None, torch.Tensor]:
    with SyncCheckpointEngine(root, keep=None) as engine:
        target = {"w": torch.zeros(n)}
        return engine.load_latest(target), target["w"]


def test_a_kill_while_handing_over_the_next_memory_save_keeps_the_one_held(tmp_path):
    """The Hold of save 3 replaced (and released) save 2's before the worker had save 3's
    memory, which it could never get from a dead trainer: neither was written, and the run
    resumed at step 1 though save(2) had returned (1 in 3 runs without the SIGSTOP). Now a
    Hold counts once its memory is mapped; the one before stays held until then."""
    lines = _run_killed(tmp_path, HANDOVER)
    assert [x["held"] for x in lines if "held" in x] == [2]  # save(2) returned, save(3) not
    wait_gone(lines[0]["worker"], 120)
    step, w = _resumed(tmp_path / "r", 1 << 20)
    assert step == 2, f"resumed at {step}; tracker {L.read_tracker(tmp_path / 'r')}"
    assert torch.equal(w, torch.full((1 << 20,), 2.0))
    assert "never reached this worker" in (tmp_path / "err").read_text()


def test_a_forked_child_holding_the_pipes_does_not_keep_the_memory_save_unwritten(tmp_path):
    """The worker writes the memory save it holds at the end of the trainer's pipe, which a
    forked child kept open: the worker waited out its orphan deadline and exited with step 2
    unwritten. Now the trainer's being gone ends the pipe once it holds nothing more."""
    info = _run_killed(tmp_path, FORKED)[0]
    try:
        wait_gone(info["worker"], 120)
    finally:
        try:
            os.kill(info["child"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    step, w = _resumed(tmp_path / "r", 1 << 16)
    assert step == 2, f"resumed at {step}; tracker {L.read_tracker(tmp_path / 'r')}"
    assert torch.equal(w, torch.full((1 << 16,), 2.0))
