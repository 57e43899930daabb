"""The Lightning adapter against a real ``lightning.Trainer`` (CPU, a Linear model)."""

from __future__ import annotations

import copy
import os
import re
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from statecmp import assert_same

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from asyncckpt import (  # noqa: E402
    CheckpointError,
    CorruptCheckpoint,
    KeepBest,
    KeepLast,
    read_checkpoint,
    verify,
)
from asyncckpt.core import layout as _layout  # noqa: E402
from asyncckpt.integrations.lightning import (  # noqa: E402
    AsyncCheckpointIO,
    load_from_checkpoint,
    retention_policy,
)

sys.path.insert(0, str(Path(__file__).parents[1]))
import lightning_train as lt  # noqa: E402

pytestmark = pytest.mark.integration  # real frameworks / several ranks: `-m integration`

REPO = Path(__file__).resolve().parents[2]


def _steps(root: Path) -> list[int]:
    return [c.step for c in _layout.scan(root, "global_step")]


def test_retention_policy_mapping() -> None:
    assert retention_policy(save_top_k=-1, monitor="loss", save_last=True) is None
    assert retention_policy(1) == KeepLast(1)
    assert retention_policy(0, save_last=True) == KeepLast(1)
    assert retention_policy(3, "val", "max") == KeepBest(3, "val", mode="max")
    assert retention_policy(2, "val", save_last=True) == KeepBest(2, "val") | KeepLast(1)
    with pytest.raises(ValueError, match="save_top_k=-2"):
        retention_policy(-2)
    with pytest.raises(ValueError, match="mode='mean'"):
        retention_policy(1, "val", "mean")


def test_read_checkpoint_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        read_checkpoint(tmp_path / "global_step_1")
    (tmp_path / ".tmp-global_step_1-abc").mkdir()
    with pytest.raises(CorruptCheckpoint, match="uncommitted temporary"):
        read_checkpoint(tmp_path / ".tmp-global_step_1-abc")
    (tmp_path / "global_step_2").mkdir()
    with pytest.raises(CheckpointError, match="no manifest, no .metadata"):
        read_checkpoint(tmp_path / "global_step_2")


def test_kill_then_resume_restores_the_committed_step(tmp_path: Path) -> None:
    """A Trainer saving every 5 steps is SIGKILLed once step 10 has committed; a new Trainer
    with ckpt_path="last" starts at the newest committed step with the weights and optimizer
    state recorded when it was saved, and retention keeps the 2 best by loss plus the newest."""
    root, out = tmp_path / "ckpts", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "tests" / "lightning_train.py"), str(root), str(out)]
    proc = subprocess.Popen(
        cmd + ["100000", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.strip())
            if line.strip() == "COMMITTED 10":
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert seen.wait(90), f"step 10 never committed: {lines}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    # The killed trainer's worker commits what was staged before the kill (step 15 at times):
    # the newest committed step is known once it has let go of the root.
    from asyncckpt.storage.localfs import lock_held, lock_path

    gone = time.monotonic() + 60
    while lock_held(lock_path(root, "worker0")) and time.monotonic() < gone:
        time.sleep(0.2)
    latest = _layout.read_tracker(root)
    assert latest is not None and latest >= 10 and latest % 5 == 0
    saved = torch.load(out / f"saved_{latest}.pt", weights_only=False)

    start: dict[str, Any] = {}

    class AtStart(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            start["step"] = trainer.global_step
            start["weights"] = {k: v.clone() for k, v in pl_module.state_dict().items()}
            start["optim"] = copy.deepcopy(trainer.optimizers[0].state_dict())

    # Let an orphaned worker of the killed run notice its parent is gone and let go of the root.
    deadline = time.monotonic() + 30
    cb = lt.checkpoint_callback(root)
    trainer = lt.trainer(latest + 10, [AtStart(), lt.Recorder(out), cb])
    while True:
        try:
            trainer.fit(lt.TinyModel(), lt.data(), ckpt_path="last")
            break
        except Exception as e:  # RootLocked while the old worker exits
            if "lock" not in str(e).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            trainer = lt.trainer(latest + 10, [AtStart(), lt.Recorder(out), cb])

    assert start["step"] == latest
    assert_same(saved["weights"], start["weights"], "weights")
    assert_same(saved["optim"], start["optim"], "optim")
    assert trainer.global_step == latest + 10

    # Retention: KeepBest(2, "loss") | KeepLast(1), over every checkpoint the root had.
    losses = {s: torch.load(out / f"saved_{s}.pt")["loss"] for s in range(5, latest + 11, 5)}
    best = sorted(losses, key=losses.get)[:2]
    assert _steps(root) == sorted(set(best) | {latest + 10}), losses
    assert _layout.read_tracker(root) == latest + 10
    assert all(s.ok for s in verify(root).checkpoints)
    assert cb.best_model_path.endswith(f"global_step_{min(losses, key=losses.get)}")


def test_plugin_with_lightning_model_checkpoint(tmp_path: Path) -> None:
    """Lightning's own ModelCheckpoint over the plugin: its paths map to asyncckpt steps, its
    last.ckpt is an alias (one write), its removals delete, and a path it saved loads back."""
    given: dict[str, Any] = {}

    class Recording(AsyncCheckpointIO):
        def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            given[os.path.basename(path)] = copy.deepcopy(checkpoint)
            super().save_checkpoint(checkpoint, path, storage_options)

    io = Recording()
    cb = ModelCheckpoint(tmp_path, every_n_train_steps=5, save_top_k=1, save_last=True)
    t = lt.trainer(15, [cb], plugins=[io])
    model = lt.TinyModel()
    t.fit(model, lt.data())
    # save_top_k=1 removed steps 5 and 10 as 10 and 15 were saved; 15 is top-1 and last.
    assert _steps(tmp_path) == [15]
    assert cb.best_model_path.endswith("epoch=0-step=15.ckpt")
    assert io.locate(cb.best_model_path) == io.locate(cb.last_model_path) == (str(tmp_path), 15)
    ckpt = io.load_checkpoint(cb.last_model_path)
    # The whole dict Lightning gave at step 15 (hparams, loops, callbacks, the empty
    # lr_schedulers list, int-keyed optimizer state), not only what a target asked for.
    saved = given["epoch=0-step=15.ckpt"]
    assert saved["lr_schedulers"] == [] and saved["optimizer_states"][0]["state"]
    assert_same(saved, ckpt)
    assert_same({f"layer.{k}": v for k, v in model.layer.state_dict().items()}, ckpt["state_dict"])
    # map_location as torch.load takes it (a CPU run: every form keeps the tensors on the CPU).
    for where in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage):
        assert_same(saved, io.load_checkpoint(cb.last_model_path, map_location=where))
    with pytest.raises(TypeError, match="map_location=5"):
        io.load_checkpoint(cb.last_model_path, map_location=5)
    # From any process: the checkpoint directory, or the root (its newest).
    assert AsyncCheckpointIO().load_checkpoint(tmp_path)["global_step"] == 15
    with pytest.raises(FileNotFoundError, match="no asyncckpt checkpoint"):
        AsyncCheckpointIO().load_checkpoint(tmp_path / "nothing.ckpt")
    with pytest.raises(Exception, match="weights_only=True"):
        io.load_checkpoint(tmp_path, weights_only=True)
    # Lightning's .ckpt name, through the plugin that saved it.
    loaded = load_from_checkpoint(lt.TinyModel, cb.best_model_path, checkpoint_io=io)
    assert_same(loaded.state_dict(), model.state_dict())
    # ... and from any process: the name is never written (the checkpoint is global_step_15),
    # but its step= part finds it; a name whose step has no checkpoint is still refused.
    assert not os.path.exists(cb.best_model_path)
    loaded = load_from_checkpoint(lt.TinyModel, cb.best_model_path)
    assert_same(loaded.state_dict(), model.state_dict())
    with pytest.raises(FileNotFoundError, match="no asyncckpt checkpoint"):
        AsyncCheckpointIO().load_checkpoint(tmp_path / "epoch=0-step=10.ckpt")
    # A new Trainer with the plugin alone resumes from the root given as ckpt_path.
    again = lt.trainer(
        20, [ModelCheckpoint(tmp_path, every_n_train_steps=5, save_top_k=1)], [AsyncCheckpointIO()]
    )
    steps_run: list[int] = []

    class Counting(lt.TinyModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            steps_run.append(self.global_step)
            return super().training_step(batch, batch_idx)

    again.fit(Counting(), lt.data(), ckpt_path=str(tmp_path))
    assert steps_run == [15, 16, 17, 18, 19] and _steps(tmp_path)[-1] == 20


def test_load_from_checkpoint_of_best_model_path(tmp_path: Path) -> None:
    """Lightning's habit ``Model.load_from_checkpoint(best_model_path)`` opens a file, and
    best_model_path is a global_step_N directory: ``load_from_checkpoint(Model, path)`` does
    it instead (hyperparameters, strict, map_location and kwargs as Lightning's own)."""
    cb = lt.checkpoint_callback(tmp_path)
    model = lt.TinyModel(lr=0.01)
    lt.trainer(15, [cb]).fit(model, lt.data())
    best = cb.best_model_path
    assert _layout.parse_dir_name("global_step", os.path.basename(best)) is not None
    with pytest.raises(IsADirectoryError):  # why the function exists
        lt.TinyModel.load_from_checkpoint(best)
    loaded = load_from_checkpoint(lt.TinyModel, best)
    assert isinstance(loaded, lt.TinyModel) and loaded.hparams.lr == 0.01
    assert_same(loaded.state_dict(), read_checkpoint(best)["state_dict"])
    # A root: its newest checkpoint (step 15, the model as trained); kwargs override hparams.
    newest = load_from_checkpoint(lt.TinyModel, tmp_path, map_location="cpu", lr=0.5)
    assert newest.hparams.lr == 0.5
    assert_same(newest.state_dict(), model.state_dict())
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_from_checkpoint(lt.TinyModel, best, weights_only=True)


def test_docs_page_snippet_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Lightning page's snippet (docs/how-to/lightning.md), run twice (in this process: Lightning is
    imported already): the second run resumes at step 10 and trains to 20."""
    text = (REPO / "docs" / "how-to" / "lightning.md").read_text()
    (code,) = [
        b
        for b in re.findall(r"```python\n(.*?)```", text, re.S)
        if b.startswith("# requires: lightning\n")
    ]
    script = tmp_path / "train_lightning.py"
    script.write_text(code)
    monkeypatch.chdir(tmp_path)
    first = runpy.run_path(str(script), run_name="__main__")
    assert (first["done"], first["trainer"].global_step, first["steps"]) == (0, 10, [5, 10])
    second = runpy.run_path(str(script), run_name="__main__")
    assert (second["done"], second["trainer"].global_step) == (10, 20)
    assert second["steps"][-1] == 20 and len(second["steps"]) <= 3

    # ckpt_path=<root> (and "last") skip a corrupt newest checkpoint, loudly.
    root = tmp_path / "ckpts-lightning"
    shard = next((root / "global_step_20").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="step 20 .* unusable"):
        ckpt = AsyncCheckpointIO().load_checkpoint(root)
    assert ckpt["global_step"] == second["steps"][-2]


def test_last_is_found_under_the_default_dirpath(tmp_path: Path) -> None:
    """dirpath=None: ckpt_path="last" is resolved before setup, so the callback must work out
    Lightning's default dirpath (default_root_dir/checkpoints) itself, not silently restart."""
    from asyncckpt.integrations.lightning import AsyncModelCheckpoint

    cb = AsyncModelCheckpoint(every_n_train_steps=5)
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, callbacks=[cb])
    assert cb._find_last_checkpoints(trainer) == set()
    (tmp_path / "checkpoints" / "global_step_5").mkdir(parents=True)
    (tmp_path / "checkpoints" / "global_step_5" / ".metadata").touch()
    assert cb._find_last_checkpoints(trainer) == {str(tmp_path / "checkpoints")}
