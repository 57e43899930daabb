"""A Megatron-style run on 2 ranks: tensor-parallel shards, asyncckpt writing Megatron's layout.

    torchrun --nproc-per-node 2 examples/megatron_style.py --root /tmp/mckpt --steps 12 --stop-at 9
    torchrun --nproc-per-node 2 examples/megatron_style.py --root /tmp/mckpt --steps 12

The first command trains to step 9 and stops (a preemption: the saves of steps 4 and 8 have
committed), the second resumes from step 8 and finishes. The root then holds what Megatron-LM
writes with ``--ckpt-format torch_dist``::

    /tmp/mckpt/latest_checkpointed_iteration.txt      -> 12 (written after the commit only)
    /tmp/mckpt/iter_0000008/ iter_0000012/            metadata.json, common.pt, .metadata,
                                                      __0_0.distcp, __1_0.distcp (one per rank)

so ``megatron.core.dist_checkpointing.load(sharded_state_dict, "/tmp/mckpt/iter_0000012")``
resumes from it without asyncckpt. Each rank holds half of the rows of a weight (a megatron
``ShardedTensor``, or a DTensor when megatron-core is not installed) and its optimizer state;
every rank writes only its own shards, and rank 0 commits once both ranks' shards are durable.
CPU and gloo here; the same code runs with NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt import KeepLast, Schedule, SyncCheckpointEngine

ROWS, COLS = 16, 8


def megatron_available() -> bool:
    try:
        import megatron.core.dist_checkpointing  # noqa: F401
    except ImportError:
        return False
    return True


class Shard:
    """This rank's rows of a tensor-parallel weight, with SGD momentum."""

    def __init__(self, rank: int, world: int) -> None:
        full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 100
        self.rank, self.world = rank, world
        self.weight = full.chunk(world)[rank].clone()
        self.momentum = torch.zeros_like(self.weight)

    def train_step(self, step: int) -> float:
        # A deterministic "gradient": pull the weight towards a step-dependent target.
        grad = self.weight - torch.sin(torch.tensor(float(step)))
        self.momentum.mul_(0.9).add_(grad)
        self.weight.sub_(0.05 * self.momentum)
        loss = grad.pow(2).sum()
        dist.all_reduce(loss)  # the training's own collective (asyncckpt never issues one)
        return loss.item()

    def sharded_state(self, step: int) -> dict[str, Any]:
        """What Megatron code hands dist_checkpointing: sharded tensors plus common state."""
        if megatron_available():
            from megatron.core.dist_checkpointing import ShardedTensor

            def sh(key: str, t: torch.Tensor) -> Any:
                return ShardedTensor.from_rank_offsets(key, t, (0, self.rank, self.world))
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard

            mesh = init_device_mesh("cpu", (self.world,))

            def sh(key: str, t: torch.Tensor) -> Any:
                return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)

        return {
            "model": {"decoder.weight": sh("decoder.weight", self.weight)},
            "optimizer": {"momentum": sh("optimizer.decoder.weight.momentum", self.momentum)},
            "iteration": step,
            "checkpoint_version": 3.0,
            "args": {"lr": 0.05, "tensor_model_parallel_size": self.world},
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="/tmp/asyncckpt-megatron-example")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (preemption)")
    p.add_argument("--format", default="torch_dist", choices=["torch_dist", "torch"])
    args = p.parse_args()

    dist.init_process_group("gloo")  # torchrun's env://; "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = Shard(rank, world)

    # One engine per rank; they find each other through the training group's store once,
    # at start, then coordinate every commit among their own worker processes.
    engine = SyncCheckpointEngine(
        args.root,
        layout="megatron",
        format=args.format,
        keep=KeepLast(2),
        schedule=Schedule(every_steps=args.save_every),
    )
    with engine:
        state = shard.sharded_state(0)
        resumed = engine.load_latest(state)  # in place: shard.weight / shard.momentum
        start = state["iteration"] if resumed is not None else 0
        if rank == 0:
            print(f"[rank 0] world {world}: " + (f"resumed from step {resumed}" if resumed
                  is not None else "fresh start"), flush=True)  # fmt: skip
        for step in range(start + 1, args.steps + 1):
            loss = shard.train_step(step)
            if engine.should_save(step):
                handle = engine.save(step, shard.sharded_state(step))  # returns once staged
                if rank == 0:
                    print(f"[rank 0] step {step}: loss {loss:.4f}, save staged "
                          f"({handle.stats.blocked_seconds * 1e3:.1f} ms)", flush=True)  # fmt: skip
            if args.stop_at is not None and step == args.stop_at:
                break
        engine.wait()  # every staged save committed (or raise)
    if rank == 0:
        tracker = open(os.path.join(args.root, "latest_checkpointed_iteration.txt")).read()
        print(f"[rank 0] done; latest_checkpointed_iteration.txt = {tracker.strip()}; "
              f"checkpoints: {sorted(n for n in os.listdir(args.root) if n.startswith('iter_'))}",
              flush=True)  # fmt: skip
    print(f"[rank {rank}] weight checksum {shard.weight.double().sum().item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
