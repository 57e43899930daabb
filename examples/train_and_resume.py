"""A small real training loop that checkpoints asynchronously, is killed, and resumes.

Run:  python examples/train_and_resume.py

Phase 1 trains a tiny MLP with AdamW, saving every 5 steps with ``KeepLast(3) | KeepEvery(20)``
(the save returns once the state is staged; the worker process writes, commits and prunes in
the background). It is SIGKILLed mid-run, as a crashed job would be. Phase 2 starts again,
resumes from the latest committed checkpoint, checks that the resumed weights equal those the
first run had at that step, and trains to the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import torch

from asyncckpt import CheckpointEngine, KeepEvery, KeepLast, Schedule

TOTAL_STEPS = 60
SAVE_EVERY = 5


def make_run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)  # data order is a function of the step: resumable
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


async def train(root: Path, kill_at: int | None) -> None:
    model, optim = make_run()
    state = {"model": model, "optim": optim, "progress": {"step": 0, "losses": []}}
    engine = CheckpointEngine(
        root, keep=KeepLast(3) | KeepEvery(20), schedule=Schedule(every_steps=SAVE_EVERY)
    )
    start = await engine.load_latest(state)
    if start is None:
        print("no checkpoint found: starting from scratch", flush=True)
        start = 0
    else:
        print(
            f"resumed from step {start} (loss history of {len(state['progress']['losses'])} steps)"
        )
        expected = torch.load(root / f"weights_at_{start}.pt")
        same = all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), expected.values(), strict=True)
        )
        print(f"resumed weights equal the weights the killed run had at step {start}: {same}")
        assert same
    async with engine:
        for step in range(start + 1, TOTAL_STEPS + 1):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            state["progress"]["step"] = step
            state["progress"]["losses"].append(round(loss.item(), 5))
            if engine.should_save(step):
                handle = await engine.save(step, state, metrics={"loss": loss.item()})
                # Reference copy for the check after resume (not part of checkpointing).
                torch.save(model.state_dict(), root / f"weights_at_{step}.pt")
                print(
                    f"step {step:3d} loss {loss.item():.4f} saved (blocked {handle.stats.blocked_seconds * 1e3:.1f} ms)",
                    flush=True,
                )
                if step == kill_at:
                    await handle.committed()
                    print(f"step {step}: simulating a crash (SIGKILL)", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
    kept = [c.step for c in engine.list_checkpoints()]
    print(f"finished at step {TOTAL_STEPS}; checkpoints on disk: {kept}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root", type=Path, default=None, help="checkpoint directory (default: a temp dir)"
    )
    parser.add_argument("--phase", choices=["all", "train"], default="all")
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    if args.phase == "train":
        anyio.run(train, args.root, args.kill_at)
        return
    root = args.root or Path(tempfile.mkdtemp(prefix="asyncckpt-example-"))
    print(f"checkpoints in {root}\n--- phase 1: train, killed at step 35")
    cmd = [sys.executable, __file__, "--phase", "train", "--root", str(root)]
    first = subprocess.run([*cmd, "--kill-at", "35"])
    print(
        f"--- phase 1 ended with {'SIGKILL' if first.returncode == -signal.SIGKILL else first.returncode}"
    )
    print("--- phase 2: restart and resume")
    second = subprocess.run(cmd)
    sys.exit(second.returncode)


if __name__ == "__main__":
    main()
