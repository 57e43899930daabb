"""A tiny Lightning run for tests/integrations/test_lightning.py: trains, checkpoints through asyncckpt.

``python tests/lightning_train.py ROOT OUT MAX_STEPS SLEEP`` prints ``COMMITTED <step>`` when a
checkpoint commits and records, at every save step, the weights and optimizer state it saves
(``OUT/saved_<step>.pt``), so a test can kill it and compare what a resume restores.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from asyncckpt.integrations.lightning import AsyncModelCheckpoint

EVERY = 5


class TinyModel(L.LightningModule):
    def __init__(self, lr: float = 0.05, sleep: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.hparams.sleep:
            time.sleep(self.hparams.sleep)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(4096, 8, generator=g), torch.randn(4096, 1, generator=g))
    return DataLoader(ds, batch_size=4)


class Recorder(L.Callback):
    """At every save step, what the checkpoint callback (which runs after it) saves."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        step = trainer.global_step
        if step % EVERY:
            return
        record = {
            "weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "optim": trainer.optimizers[0].state_dict(),
            "loss": float(trainer.callback_metrics["loss"]),
        }
        tmp = self.out / f".saved_{step}.pt"
        torch.save(record, tmp)
        os.replace(tmp, self.out / f"saved_{step}.pt")


def checkpoint_callback(root: str | os.PathLike, **engine_options: Any) -> AsyncModelCheckpoint:
    return AsyncModelCheckpoint(
        root,
        monitor="loss",
        mode="min",
        save_top_k=2,
        every_n_train_steps=EVERY,
        save_last=True,
        engine_options=engine_options,
    )


def trainer(max_steps: int, callbacks: list, plugins: list | None = None) -> L.Trainer:
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=plugins,
    )


def main() -> None:
    root, out, max_steps, sleep = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])

    def on_commit(stats: Any) -> None:
        print(f"COMMITTED {stats.step}", flush=True)

    torch.manual_seed(0)
    cb = checkpoint_callback(root, on_commit=on_commit)
    trainer(max_steps, [Recorder(out), cb]).fit(TinyModel(sleep=sleep), data(), ckpt_path="last")
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
