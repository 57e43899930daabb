"""The HF Trainer adapter against a real ``transformers.Trainer`` (tiny config-built GPT-2, CPU)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from asyncckpt import (  # noqa: E402
    CheckpointError,
    KeepBest,
    KeepLast,
    StateMismatch,
    SyncCheckpointEngine,
)
from asyncckpt.integrations.hf import (  # noqa: E402
    AsyncCheckpointCallback,
    load_checkpoint,
    policy_from_args,
)

pytestmark = pytest.mark.integration  # real frameworks / several ranks: `-m integration`

ROOT = Path(__file__).resolve().parents[2]


class Rows(torch.utils.data.Dataset):
    """Fixed token rows; labels = input_ids (causal LM)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 100, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # No dropout: the resumed run can then be compared with an uninterrupted one.
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def args(out: Path, **kw) -> transformers.TrainingArguments:
    base = dict(
        output_dir=str(out),
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        save_strategy="no",
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def exp_avg(optimizer) -> list[torch.Tensor]:
    return [s["exp_avg"].clone() for s in optimizer.state_dict()["state"].values()]


class Recorder(transformers.TrainerCallback):
    """Weights and optimizer moments at each step end; stops the run at ``stop_at`` (a crash:
    nothing saved after the last commit)."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.moments: dict[int, list[torch.Tensor]] = {}
        self.steps_run: list[int] = []
        self.at_begin: tuple[int, dict, list] | None = None
        self.rng: dict[int, torch.Tensor] = {}
        self.epochs: dict[int, float] = {}
        self.rng_at_begin: torch.Tensor | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        # Runs after AsyncCheckpointCallback (added earlier): sees the restored state.
        moments = exp_avg(optimizer) if optimizer.state_dict()["state"] else []
        self.at_begin = (state.global_step, snapshot(model), moments)
        self.rng_at_begin = torch.get_rng_state()

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
        self.steps_run.append(state.global_step)
        self.weights[state.global_step] = snapshot(model)
        self.moments[state.global_step] = exp_avg(optimizer)
        self.rng[state.global_step] = torch.get_rng_state()
        self.epochs[state.global_step] = state.epoch
        if state.global_step == self.stop_at:
            control.should_training_stop = True


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if tol:
            torch.testing.assert_close(a[k], b[k], **tol, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


def test_policy_from_args_maps_hf_rotation(tmp_path: Path) -> None:
    assert policy_from_args(args(tmp_path)) is None
    assert policy_from_args(args(tmp_path, save_total_limit=3)) == KeepLast(3)
    best = args(
        tmp_path,
        save_total_limit=2,
        load_best_model_at_end=True,
        eval_strategy="steps",
        save_strategy="steps",
        eval_steps=4,
        save_steps=4,
        metric_for_best_model="accuracy",
        greater_is_better=True,
    )
    assert policy_from_args(best) == KeepLast(2) | KeepBest(1, "eval_accuracy", "max")
    # HF's default metric is the eval loss, lower is better.
    loss = args(
        tmp_path,
        save_total_limit=1,
        load_best_model_at_end=True,
        eval_strategy="steps",
        save_strategy="steps",
        eval_steps=4,
        save_steps=4,
    )
    assert policy_from_args(loss) == KeepLast(1) | KeepBest(1, "eval_loss", "min")


def test_save_crash_resume_continues_from_committed_step(tmp_path: Path) -> None:
    data = Rows(4, seed=1)  # one batch per epoch: the data order cannot differ after a resume
    ckpts = tmp_path / "ckpts"

    # The uninterrupted reference run.
    ref = Recorder()
    transformers.Trainer(
        model=tiny_model(0), args=args(tmp_path / "ref"), train_dataset=data, callbacks=[ref]
    ).train()

    # Run 1: saves every 4 steps (the callback's own schedule), "crashes" at step 10.
    run1 = Recorder(stop_at=10)
    cb1 = AsyncCheckpointCallback(ckpts, save_steps=4)
    t1 = transformers.Trainer(
        model=tiny_model(0), args=args(tmp_path / "o1"), train_dataset=data, callbacks=[cb1, run1]
    )
    t1.train()
    assert [h.step for h in cb1.handles] == [4, 8]
    assert [c.step for c in SyncCheckpointEngine(ckpts).list_checkpoints()] == [4, 8]
    assert not list((tmp_path / "o1").glob("checkpoint-*"))
    assert_same(run1.weights[8], ref.weights[8])

    # Run 2: a fresh model (other init), fresh Trainer, resumes from the committed step 8.
    run2 = Recorder()
    cb2 = AsyncCheckpointCallback(ckpts, save_steps=4, resume=True)
    t2 = transformers.Trainer(
        model=tiny_model(123), args=args(tmp_path / "o2"), train_dataset=data, callbacks=[cb2, run2]
    )
    t2.train()
    assert cb2.resumed_step == 8
    step, weights, moments = run2.at_begin
    assert step == 8
    assert_same(weights, run1.weights[8])
    assert len(moments) == len(run1.moments[8])
    for got, want in zip(moments, run1.moments[8], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(run2.rng_at_begin, run1.rng[8])  # the RNG as it was at step 8
    assert run2.steps_run == [9, 10, 11, 12]  # continued, not restarted from 0
    assert t2.state.global_step == 12
    # One batch per epoch: the epoch counter goes on from the resumed epoch, not from 0.
    assert run2.epochs == {9: 9.0, 10: 10.0, 11: 11.0, 12: 12.0}
    assert ref.epochs[12] == 12.0
    # Same optimizer moments, lr schedule and data: the resumed run lands where the
    # uninterrupted one did (up to float summation order within a shuffled batch).
    assert_same(run2.weights[12], ref.weights[12], rtol=1e-4, atol=1e-5)
    assert [c.step for c in SyncCheckpointEngine(ckpts).list_checkpoints()] == [4, 8, 12]

    # Resuming a run that already reached max_steps: HF would still run one more step (and
    # change the weights) before checking max_steps, so it is refused, naming the numbers.
    t3 = transformers.Trainer(
        model=tiny_model(0),
        args=args(tmp_path / "o3"),
        train_dataset=data,
        callbacks=[AsyncCheckpointCallback(ckpts, resume=True)],
    )
    with pytest.raises(CheckpointError, match="resumed from step 12 .* max_steps=12"):
        t3.train()

    # Resuming into a model of another shape names the tensor and changes nothing.
    other = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=100, n_positions=32)
    )
    before = snapshot(other)
    t4 = transformers.Trainer(
        model=other,
        args=args(tmp_path / "o4", max_steps=20),
        train_dataset=data,
        callbacks=[AsyncCheckpointCallback(ckpts, resume=True)],
    )
    with pytest.raises(StateMismatch, match=r"model\.transformer\.wte\.weight"):
        t4.train()
    assert_same(snapshot(other), before)

    # The standalone loader reads the same checkpoints into a bare model.
    bare = tiny_model(7)
    assert load_checkpoint(ckpts, bare, step=8) == 8
    assert_same(snapshot(bare), run1.weights[8])


def test_best_checkpoint_survives_rotation_and_is_loaded_at_end(tmp_path: Path) -> None:
    scores = iter([0.5, 0.9, 0.1, 0.2, 0.3, 0.4])  # evaluations at steps 2, 4, ..., 12: 4 is best

    def compute_metrics(_pred) -> dict[str, float]:
        return {"score": next(scores)}

    ckpts = tmp_path / "ckpts"
    rec = Recorder()
    cb = AsyncCheckpointCallback(ckpts)  # follows HF's save_strategy / save_steps
    trainer = transformers.Trainer(
        model=tiny_model(0),
        args=args(
            tmp_path / "out",
            save_strategy="steps",
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            per_device_eval_batch_size=4,
            save_total_limit=2,
            load_best_model_at_end=True,
            metric_for_best_model="score",
            greater_is_better=True,
        ),
        train_dataset=Rows(8, seed=1),
        eval_dataset=Rows(4, seed=2),
        compute_metrics=compute_metrics,
        callbacks=[cb, rec],
    )
    trainer.train()
    assert [h.step for h in cb.handles] == [2, 4, 6, 8, 10, 12]
    infos = SyncCheckpointEngine(ckpts).list_checkpoints()
    # KeepLast(2) | KeepBest(1, eval_score, max): the newest two and the best.
    assert [c.step for c in infos] == [4, 10, 12]
    assert {c.step: c.metrics["eval_score"] for c in infos} == {4: 0.9, 10: 0.3, 12: 0.4}
    # HF wrote no checkpoint-N directories of its own.
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    # load_best_model_at_end: the model holds step 4's weights, as HF's own bookkeeping agrees.
    assert trainer.state.best_global_step == 4
    assert cb.best_step == 4
    assert_same(snapshot(trainer.model), rec.weights[4])


def test_follows_epoch_strategy_with_each_epochs_eval_metrics(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    cb = AsyncCheckpointCallback(ckpts)
    transformers.Trainer(
        model=tiny_model(0),
        args=args(
            tmp_path / "out",
            max_steps=4,
            save_strategy="epoch",
            eval_strategy="epoch",
            per_device_eval_batch_size=4,
        ),
        train_dataset=Rows(8, seed=1),  # 2 steps per epoch
        eval_dataset=Rows(4, seed=2),
        callbacks=[cb],
    ).train()
    assert [h.step for h in cb.handles] == [2, 4]
    infos = SyncCheckpointEngine(ckpts).list_checkpoints()
    assert [c.step for c in infos] == [2, 4]
    assert all("eval_loss" in c.metrics for c in infos)  # saved after that epoch's evaluation
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_save_strategy_best_is_refused_loudly(tmp_path: Path) -> None:
    cb = AsyncCheckpointCallback(tmp_path / "ckpts")
    trainer = transformers.Trainer(
        model=tiny_model(0),
        args=args(
            tmp_path / "out",
            save_strategy="best",
            eval_strategy="steps",
            eval_steps=2,
            metric_for_best_model="loss",
        ),
        train_dataset=Rows(4, seed=1),
        eval_dataset=Rows(4, seed=2),
        callbacks=[cb],
    )
    with pytest.raises(CheckpointError, match='save_strategy="best"'):
        trainer.train()


def test_docs_page_snippet_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (ROOT / "docs" / "how-to" / "hf-trainer.md").read_text()
    blocks = [
        b
        for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
        if b.startswith("# requires: transformers")
    ]
    assert len(blocks) == 1, (
        "the Hugging Face Trainer page (docs/how-to/hf-trainer.md) has one snippet"
    )
    # In-process (a subprocess would pay the transformers import again).
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "hf-trainer.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "first run ended at step 8" in out
    assert "second run resumed from step 8, ended at step 16" in out
    assert "['global_step_12', 'global_step_16']" in out  # save_total_limit=2
