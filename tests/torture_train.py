"""A tiny training loop for crash-recovery tests, run as a subprocess by ``test_torture.py``.

The state at step ``s`` is a deterministic function of ``s`` (``make_state``), so whoever
restarts after a crash can recompute what the loop had at the step it resumed from and compare
it bit for bit. The loop saves every step with ``KeepLast(2)``; faults come from the
environment (``ASYNCCKPT_FAULTS``), kills from the test.

    python tests/torture_train.py ROOT --steps N [--step-sleep SECONDS]
        [--memory-every K --disk-every D] [--die-after-saves N [--die-tier memory]]
    python tests/torture_train.py ROOT --world W --rank R --store FILE [--disk-every D]

``--world``: one rank of a run on simulated nodes (torchrun's ``GROUP_RANK`` etc. from the
environment), ``MemoryTier(replicas=1)``, a memory save every step whose replica it waits for
(``{"event": "replicated", "step"}``), until the test kills it (``node_main``).

``--memory-every``: ``engine.due(step)`` picks the tier (a disk save every D steps, a memory
save every K). ``--die-after-saves N``: the trainer SIGKILLs itself right after the N-th save
returned (with ``--die-tier memory``: the first memory save from the N-th save on), having
reported it: a restart must resume from exactly that step.

It prints one JSON object per line on stdout:

* ``{"event": "started", "pid", "worker_pid", "resumed", "state_ok", "leftovers"}`` once the
  engine has started (which removes leftovers) and ``load_latest`` has run; ``state_ok`` is
  whether the loaded state equals ``make_state(resumed)`` bit for bit; ``leftovers`` lists
  temporaries or trash still in the root.
* ``{"event": "saving", "step"}`` before ``save`` (``node_main`` only);
  ``{"event": "staged", "step", "tier"}`` when ``save`` returned (``{"event": "skipped", ...}``
  when it returned a skipped memory save, which holds nothing and does not count as a save);
  ``{"event": "committed", "step"}``
  when a checkpoint committed (from the engine's ``on_commit``).
* ``{"event": "save_failed", "type", "error"}`` when a save failed (the worker died, a fault
  raised), then it exits with code 3.
* ``{"event": "done", "last_step", "worker_restarts"}`` at the end (exit code 0).

Exit code 4: the resumed state did not match its recomputation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

_print_lock = threading.Lock()


def emit(**event: Any) -> None:
    line = json.dumps(event) + "\n"
    with _print_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def make_state(step: int, rank: int = 0) -> dict[str, Any]:
    """What the loop holds after step ``step``: a function of the step (and the rank, in a
    ``--world`` run, so that a mix of two ranks' steps cannot pass for one) and nothing else."""
    g = torch.Generator().manual_seed(10_000 + step + 1_000_003 * rank)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.randn(32, generator=g).to(torch.bfloat16),
        },
        "optim": {
            "exp_avg": torch.rand(512, generator=g, dtype=torch.float64),
            "count": torch.tensor([step, step * 3], dtype=torch.int64),
        },
        "extra": {"step": step, "tag": f"step-{step}", "history": list(range(step % 5))},
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def same_state(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two states (dtypes and shapes included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and _bits(a) == _bits(b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def advance(state: dict[str, Any], step: int) -> None:
    """Move ``state`` to ``make_state(step)`` in place, as a training step mutates its tensors."""
    new = make_state(step)
    with torch.no_grad():
        for group in ("model", "optim"):
            for k, v in new[group].items():
                state[group][k].copy_(v)
    state["extra"] = new["extra"]


def rank_state(step: int, rank: int) -> dict[str, Any]:
    """A ``--world`` run's state of one rank: its tensors under its own name."""
    s = make_state(step, rank)
    return {f"rank{rank}": {"model": s["model"], "optim": s["optim"]}}


def node_main(args: argparse.Namespace) -> int:
    """One rank of a ``--world`` run on simulated nodes (torchrun's environment), with
    ``MemoryTier(replicas=1)``: a memory save every step, a disk save every ``--disk-every``;
    each memory save's replica is waited for and reported (``replicated``) before the next
    step. It runs until the test kills it."""
    import torch.distributed as dist

    from asyncckpt import (
        Distributed,
        KeepLast,
        MemoryTier,
        NotReplicated,
        Schedule,
        SyncCheckpointEngine,
    )

    rank, world = args.rank, args.world
    dist.init_process_group(
        "gloo", store=dist.FileStore(args.store, world), rank=rank, world_size=world
    )
    engine = SyncCheckpointEngine(
        args.root,
        keep=KeepLast(2),
        distributed=Distributed(timeout=40),
        memory=MemoryTier(replicas=1),
        on_commit=lambda st: emit(event="committed", step=st.step),
        schedule=Schedule(every_steps=args.disk_every, memory_every_steps=1),
    )
    engine.__enter__()  # never left: the test kills this process
    emit(event="started", pid=os.getpid(), worker_pid=engine.worker_pid, resumed=None)
    for step in range(1, 1_000_000):
        state = rank_state(step, rank)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        tier = engine.due(step) or "memory"
        emit(event="saving", step=step)  # before: a kill may land between return and "staged"
        handle = engine.save(step, state, tier=tier)
        emit(event="staged", step=step, tier=tier)
        if tier == "memory":
            try:
                handle.replicated_sync(60)
                emit(event="replicated", step=step)
            except NotReplicated as e:
                emit(event="not_replicated", step=step, error=str(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    from asyncckpt import KeepLast, SaveFailed, Schedule, SyncCheckpointEngine
    from asyncckpt.core import layout as L

    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--memory-every", type=int, default=None)
    p.add_argument("--disk-every", type=int, default=1)
    p.add_argument("--die-after-saves", type=int, default=None)
    p.add_argument("--die-tier", choices=("disk", "memory"), default=None)
    p.add_argument("--world", type=int, default=1, help="ranks on simulated nodes")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--store", default=None, help="the ranks' FileStore (--world)")
    args = p.parse_args(argv)
    if args.world > 1:
        return node_main(args)

    state = make_state(0)
    # Start from something no checkpoint holds, so a load that does nothing is caught.
    with torch.no_grad():
        for group in ("model", "optim"):
            for t in state[group].values():
                t.zero_()
    engine = SyncCheckpointEngine(
        args.root,
        keep=KeepLast(2),
        on_commit=lambda st: emit(event="committed", step=st.step),
        schedule=Schedule(
            every_steps=args.disk_every if args.memory_every else None,
            memory_every_steps=args.memory_every,
        ),
    )
    saves = 0
    with engine:
        resumed = engine.load_latest(state)
        ok = resumed is not None and same_state(state, make_state(resumed))
        leftovers = sorted(n for n in os.listdir(args.root) if L.is_leftover(n))
        emit(
            event="started",
            pid=os.getpid(),
            worker_pid=engine.worker_pid,
            resumed=resumed,
            state_ok=ok,
            leftovers=leftovers,
        )
        if resumed is None:
            state = make_state(0)
        elif not ok:
            return 4
        first = 0 if resumed is None else resumed + 1
        step = first - 1
        try:
            for step in range(first, first + args.steps):
                if step != first or resumed is not None:
                    advance(state, step)
                if args.step_sleep:
                    time.sleep(args.step_sleep)  # "compute"
                tier = engine.due(step) if args.memory_every else "disk"
                if tier is None:
                    continue
                handle = engine.save(step, state, tier=tier)
                if handle.skipped:  # a memory save with no free slot holds nothing: no promise
                    emit(event="skipped", step=step, tier=tier)
                    continue
                emit(event="staged", step=step, tier=tier)
                saves += 1
                die = args.die_after_saves is not None and saves >= args.die_after_saves
                if die and args.die_tier in (None, tier):
                    os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
            engine.wait()
        except SaveFailed as e:
            emit(
                event="save_failed",
                type=type(e).__name__,
                error=str(e),
                worker_restarts=engine.worker_restarts,
            )
            return 3
    emit(event="done", last_step=step, worker_restarts=engine.worker_restarts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
