"""A user's mistakes get clear errors before anything is written (issue 11)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from asyncckpt import CheckpointEngine, Preemption, RetentionPolicy, SyncCheckpointEngine
from asyncckpt.testing import parts


def test_sync_with_on_the_async_engine_points_to_the_sync_engine(tmp_path):
    engine = CheckpointEngine(tmp_path / "ckpts")
    with pytest.raises(TypeError, match="SyncCheckpointEngine"):
        with engine:
            pass
    assert not (tmp_path / "ckpts").exists()  # nothing started, nothing written


def test_sync_engine_still_works_as_a_context_manager(tmp_path):
    with SyncCheckpointEngine(
        tmp_path / "ckpts", preemption=Preemption(handle_sigterm=False)
    ) as engine:
        engine.save(1, {"x": 1})
    assert engine.latest_step() == 1


@pytest.mark.parametrize(
    "root, match",
    [
        ("nosuchfs://bucket/run", "no fsspec back-end knows nosuchfs://"),
        (Path("s3://bucket/run"), "a Path\\(\\) of a URL has lost a '/'"),
    ],
)
def test_url_roots_nothing_can_serve_are_refused_before_anything_is_written(
    tmp_path, monkeypatch, root, match
):
    from asyncckpt import CheckpointError, UnsupportedStorage

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorage, match=match) as e:
        SyncCheckpointEngine(root, preemption=Preemption(handle_sigterm=False))
    assert isinstance(e.value, CheckpointError)
    assert list(tmp_path.iterdir()) == []  # no local directory named "s3:"


class _PolicyWithALambda(RetentionPolicy):
    def __init__(self) -> None:
        self.score = lambda c: c.step

    def keep(self, checkpoints):
        return {c.step for c in checkpoints}


def test_an_unpicklable_policy_is_refused_when_the_engine_is_made(tmp_path):
    with pytest.raises(TypeError, match="keep= must be picklable .*lambda"):
        SyncCheckpointEngine(tmp_path / "ckpts", keep=_PolicyWithALambda())
    assert not (tmp_path / "ckpts").exists()


def test_a_job_that_cannot_be_pickled_fails_its_save_and_leaves_the_worker_alone(tmp_path):
    """Pickled before the pipe: the error is the save's, the pipe stays whole, the worker lives
    (before: the half-sent message made the engine kill and replace its worker)."""
    import torch

    from asyncckpt import SaveFailed

    with SyncCheckpointEngine(
        tmp_path / "ckpts", preemption=Preemption(handle_sigterm=False)
    ) as engine:
        engine.save(1, {"x": torch.ones(3)})
        engine.wait()
        pid = engine.worker_pid
        saver = parts(engine).saver
        rules = saver.rules
        saver.rules = dataclasses.replace(rules, keep=_PolicyWithALambda())  # slipped past
        with pytest.raises(SaveFailed, match="cannot be sent to the checkpoint worker"):
            engine.save(2, {"x": torch.ones(3)})
        saver.rules = rules
        engine.save(3, {"x": torch.ones(3)}).committed_sync(60)
        assert engine.worker_pid == pid and engine.worker_restarts == 0
    assert [c.step for c in engine.list_checkpoints()] == [1, 3]


@pytest.mark.parametrize("value", ["0.5", b"0.5", "nan"])
def test_a_string_metric_is_refused_before_anything_is_staged(tmp_path, value):
    """``float("0.5")`` would convert it silently; a string is a mistake the caller must see."""
    import torch

    from asyncckpt.core import layout as L

    with SyncCheckpointEngine(tmp_path) as engine:
        with pytest.raises(TypeError, match=r"metric 'val_loss' must be a number, got the string"):
            engine.save(1, {"w": torch.ones(2)}, metrics={"val_loss": value})
        assert L.scan(tmp_path, "global_step") == []
        # Numbers of every kind still go through, and the same step saves.
        engine.save(1, {"w": torch.ones(2)}, metrics={"val_loss": torch.tensor(0.5), "acc": 1})
        engine.wait()
    assert [c.step for c in L.scan(tmp_path, "global_step")] == [1]


def test_a_missing_huggingface_hub_is_refused_when_the_engine_is_made(tmp_path, monkeypatch):
    """An HF export needs huggingface_hub; without it the engine is not made (before, the
    first due step committed and only its export failed, in the worker)."""
    import sys

    from asyncckpt.worker.export import HFExport

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # its import now fails
    export = HFExport(every_steps=1, path=tmp_path / "hf")
    with pytest.raises(ImportError, match="huggingface_hub.*pip install"):
        SyncCheckpointEngine(tmp_path / "ckpt", export=export)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "hf").exists()


def test_an_export_into_the_checkpoint_root_is_refused_when_the_engine_is_made(tmp_path):
    """``HFExport(path=<the checkpoint root>)`` was refused only by the worker, at the first
    due step (``ExportFailed`` after that step committed): a misconfigured run learnt of it
    one export interval in. Now the engine is not made."""
    from asyncckpt.worker.export import HFExport

    root = tmp_path / "ckpt"
    for path in (root, tmp_path / "ckpt" / ".." / "ckpt"):
        with pytest.raises(ValueError, match="is the checkpoint root"):
            SyncCheckpointEngine(root, export=HFExport(every_steps=1, path=path))
    assert not root.exists()


@pytest.mark.parametrize("dtype", ["bits8", "bits16", "bits1x8"])
def test_a_bits_dtype_is_refused_at_save_naming_its_key(tmp_path, dtype):
    """``torch.bits*`` tensors passed ``save()`` and failed in the worker, naming nothing
    (DCP cannot write them: ``torch.iinfo`` refuses them)."""
    import torch

    state = {
        "w": torch.zeros(8),
        "raw": torch.zeros(8, dtype=torch.uint8).view(getattr(torch, dtype)),
    }
    with SyncCheckpointEngine(tmp_path) as engine:
        with pytest.raises(TypeError, match="raw"):
            engine.save(1, state)
    assert engine.latest_step() is None


def test_a_tensor_made_under_inference_mode_is_saved_and_loads_back(tmp_path):
    """Inference tensors have no version counter; reading it failed every save of a state
    holding one (``torch.save`` and ``dcp.save`` take them)."""
    import torch

    with torch.inference_mode():
        frozen = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: a copy-skip candidate
    state = {"w": torch.ones(8), "frozen": frozen}
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state).committed_sync()
        engine.save(2, state).committed_sync()
    target = {"w": torch.zeros(8), "frozen": torch.zeros(1 << 18)}
    with SyncCheckpointEngine(tmp_path) as engine:
        assert engine.load_latest(target) == 2
    assert torch.equal(target["frozen"], frozen) and torch.equal(target["w"], state["w"])
