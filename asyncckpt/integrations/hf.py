"""Hugging Face ``transformers.Trainer`` integration: asynchronous saves from a ``TrainerCallback``.

``trainer.add_callback(AsyncCheckpointCallback("ckpts/"))`` and the Trainer's own save schedule
(``save_strategy`` / ``save_steps``) now writes asyncckpt checkpoints in the background instead of
HF's blocking ``checkpoint-N`` directories. Retention follows ``save_total_limit`` (the newest N)
and ``load_best_model_at_end`` + ``metric_for_best_model`` + ``greater_is_better`` (the best one is
never rotated out, and is loaded into the model when training ends). ``resume=True`` restores the
model, optimizer, scheduler, trainer state and RNG at the start of ``train()``.

Why a callback restores instead of ``train(resume_from_checkpoint=...)``: the Trainer builds its
optimizer and scheduler and resets ``trainer.state`` *inside* ``train()``, and its own resume reads
only its ``checkpoint-N`` files. ``on_train_begin`` is the first moment all of them exist.

Needs ``pip install asyncckpt[hf]`` (transformers, accelerate); imported only from here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from asyncckpt.engine import SaveHandle
from asyncckpt.errors import CheckpointError, StateMismatch
from asyncckpt.retention import KeepBest, KeepLast, RetentionPolicy
from asyncckpt.sync import SyncCheckpointEngine

__all__ = ["AsyncCheckpointCallback", "load_checkpoint", "policy_from_args", "trainer_param_groups"]

log = logging.getLogger("asyncckpt")

# TrainerState fields that describe the run's progress; the rest (max_steps, eval_steps, ...)
# comes from this run's TrainingArguments, as after HF's own resume.
_RESTORED_STATE_FIELDS = (
    "global_step",
    "epoch",
    "num_input_tokens_seen",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
)


def _metric_name(metric: str) -> str:
    # HF compares `eval_<metric>` unless the name already has the prefix (Trainer._determine_best_metric).
    return metric if metric.startswith("eval_") else f"eval_{metric}"


def policy_from_args(args: TrainingArguments) -> RetentionPolicy | None:
    """The asyncckpt policy equal to HF's rotation: ``save_total_limit`` -> ``KeepLast(N)``, plus
    ``KeepBest(1, eval_<metric_for_best_model>, mode)`` when ``load_best_model_at_end`` (HF always
    retains the best checkpoint then). ``None`` (keep everything) without ``save_total_limit``."""
    limit = args.save_total_limit
    if limit is None or limit <= 0:
        return None
    policy: RetentionPolicy = KeepLast(int(limit))
    if args.load_best_model_at_end:
        mode = "max" if args.greater_is_better else "min"
        policy = policy | KeepBest(1, _metric_name(args.metric_for_best_model or "loss"), mode)
    return policy


def _rng_state() -> dict[str, Any]:
    # What HF's Trainer._save_rng_state keeps: python, numpy, torch CPU and CUDA generators.
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
        "cuda": cuda,
    }


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _numeric(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    # Eval metrics also carry runtimes and "epoch"; the manifest takes numbers only.
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    return out


class _HoldStrictWarning(logging.Filter):
    """Drops the engine's "loaded ... with strict=False" warning (load_checkpoint tells it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("loaded %s with strict=False")


def trainer_param_groups(model: torch.nn.Module, weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """The parameter groups ``Trainer`` builds its optimizer with: the parameters weight decay
    applies to (``weight_decay``), then the others (biases and norms, no decay), each group
    only the parameters that require a gradient. An optimizer made of them loads the Trainer's
    optimizer state: ``AdamW(trainer_param_groups(model, args.weight_decay), lr=...)``."""
    from transformers import Trainer

    # (It reads only the model: Trainer's own rule, whatever this transformers version says.)
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def load_checkpoint(
    root: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    *,
    step: int | None = None,
) -> int | None:
    """Load ``model`` (and ``optimizer`` / ``scheduler`` if given) in place from a checkpoint that
    :class:`AsyncCheckpointCallback` wrote: the newest good one, or ``step``. Returns the step, or
    ``None`` when ``root`` has no checkpoint (and ``step`` is not given). For use outside
    ``Trainer.train()`` (evaluation, export); inside it, pass ``resume=True`` to the callback.

    The Trainer's optimizer has two parameter groups (decay / no decay): build ``optimizer``
    from :func:`trainer_param_groups` (``AdamW(model.parameters())`` has one group and is
    refused, saying so).
    """
    state: dict[str, Any] = {"model": model}
    if optimizer is not None:
        state["optimizer"] = optimizer
    if scheduler is not None:
        state["scheduler"] = scheduler
    engine = SyncCheckpointEngine(root)
    # The checkpoint holds more components than asked for: load what was asked, but refuse to
    # leave any asked-for tensor at its old value. The components not asked for are skipped on
    # purpose: the engine's strict=False warning (every skipped key) is held back, and only
    # what concerns the asked-for ones is told (below).
    skipping = _HoldStrictWarning()
    logging.getLogger("asyncckpt").addFilter(skipping)
    try:
        if step is None:
            loaded = engine.load_latest(state, strict=False)
            if loaded is None:
                return None
        else:
            loaded = engine.load(state, step=step, strict=False)
    except StateMismatch as e:
        if optimizer is not None and "parameter group" in str(e):
            raise StateMismatch(
                f"the optimizer's {len(optimizer.param_groups)} parameter group(s) do not match "
                f"the checkpoint's under {os.fspath(root)!r} (the Trainer builds two: decay / no "
                "decay); build it as the Trainer does: "
                "AdamW(hf.trainer_param_groups(model, args.weight_decay), lr=args.learning_rate)"
            ) from e
        raise
    finally:
        logging.getLogger("asyncckpt").removeFilter(skipping)
    report = engine.last_load_report
    unexpected = [k for k in (report.unexpected if report else []) if k.split(".")[0] in state]
    if unexpected:
        log.warning(
            "loaded step %s of %s: did not load %s (not in the target)", loaded, root, unexpected
        )
    if report is not None and (report.missing or report.missing_objects):
        raise StateMismatch(
            f"checkpoint step {loaded} under {os.fspath(root)!r} lacks parts of the target: "
            f"missing {list(report.missing) + list(report.missing_objects)}; the target is partly "
            "loaded -- is this the right model for this checkpoint?"
        )
    return loaded


class AsyncCheckpointCallback(TrainerCallback):
    """Save the Trainer's state asynchronously into ``root`` (global_step_N directories).

    When it saves: by default on the Trainer's own schedule (``save_strategy="steps"`` /
    ``"epoch"``, ``save_steps``, and at the end of training as HF does); or, with
    ``save_steps=N`` here, every N optimizer steps and at the last step, whatever
    ``save_strategy`` is (use ``save_strategy="no"`` then). A save at a step that also evaluates
    waits for that evaluation so its metrics go into the checkpoint (``KeepBest`` ranks them);
    a save at a step without evaluation carries no metrics.

    HF's own checkpoint-N writing: turned off (``hf_checkpoints=False``, the default) by clearing
    ``control.should_save`` once this callback has taken the save, so nothing is written twice;
    ``hf_checkpoints=True`` lets HF write its directories as well.

    Retention: ``keep`` if given, else :func:`policy_from_args` (``save_total_limit``,
    ``load_best_model_at_end``, ``metric_for_best_model``, ``greater_is_better``). With
    ``load_best_model_at_end`` the best checkpoint's weights are loaded into the model in
    ``on_train_end`` (HF's own loading finds no checkpoint-N directory and does nothing).

    ``resume=True`` loads the newest good checkpoint in ``on_train_begin`` (``resume=N``: step N)
    -- model, optimizer, lr scheduler, RNG, and the TrainerState's progress (``global_step``,
    ``epoch``, ``log_history``, ``best_metric``, ...) -- so training continues from that step up
    to ``max_steps``. ``resumed_step`` says which step (``None``: started fresh). The data loader
    starts a new pass (as HF's ``ignore_data_skip=True``), counted as the next epoch. Resuming
    at a step that already reaches ``max_steps`` raises ``CheckpointError`` (the Trainer would
    run one more step before it checks).

    Extra keyword arguments go to :class:`asyncckpt.SyncCheckpointEngine` (``staging``,
    ``on_commit``, ``throttle``, ...). ``on_train_end`` waits for every save to commit and
    stops the worker; if training raises, call :meth:`close` (an unclosed engine is also drained
    at interpreter exit).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        save_steps: int | None = None,
        keep: RetentionPolicy | None = None,
        resume: bool | int = False,
        hf_checkpoints: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        if save_steps is not None and (isinstance(save_steps, bool) or int(save_steps) < 1):
            raise ValueError(f"save_steps must be a positive int or None, got {save_steps!r}")
        if "keep" in engine_kwargs:
            raise TypeError("pass keep= directly, not inside engine_kwargs")
        self.root = root
        self.save_steps = save_steps
        self.keep = keep
        self.resume = resume
        self.hf_checkpoints = hf_checkpoints
        self.engine_kwargs = engine_kwargs
        self.engine: SyncCheckpointEngine | None = None
        self.resumed_step: int | None = None
        self.handles: list[SaveHandle] = []
        self.best_step: int | None = None
        self._pending: int | None = None  # a save waiting for this step's evaluation
        self._last_saved: int | None = None
        self._eval_metrics: dict[str, float] = {}
        self._eval_step: int | None = None
        self._epoch_offset = 0  # epochs done before a resume (the Trainer's loop restarts at 0)

    # -- engine lifetime -------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if args.save_strategy == "best" and self.save_steps is None:
            # HF decides a "best" save after on_evaluate, too late for this callback to take it.
            raise CheckpointError(
                'AsyncCheckpointCallback cannot follow save_strategy="best"; use '
                'save_strategy="steps" with load_best_model_at_end=True (the best checkpoint is '
                "kept by retention), or pass save_steps= to the callback"
            )
        keep = self.keep if self.keep is not None else policy_from_args(args)
        engine = SyncCheckpointEngine(self.root, keep=keep, **self.engine_kwargs)
        self._pending = None
        self._last_saved = None
        self._epoch_offset = 0
        self.resumed_step = None
        if self.resume is not False:
            self.resumed_step = self._load(engine, state, kwargs)
            if self.resumed_step is not None and state.global_step >= state.max_steps:
                # The Trainer would still run one step before it checks max_steps again.
                raise CheckpointError(
                    f"resumed from step {self.resumed_step} under {os.fspath(self.root)!r}, which "
                    f"already reaches max_steps={state.max_steps}: nothing left to train (raise "
                    "max_steps to train on)"
                )
        engine.__enter__()
        self.engine = engine

    def close(self) -> None:
        """Wait for every staged save to commit and stop the worker (idempotent)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.engine is None:
            return
        if self._pending is not None:  # the evaluation we waited for never came
            self._save(state, kwargs, metrics=None)
        engine = self.engine
        try:
            engine.wait()  # raises a failed save: it must not pass silently at the end
        finally:
            self.close()
        if args.load_best_model_at_end:
            self._load_best(args, engine, kwargs["model"])

    # -- triggers --------------------------------------------------------------------------

    def _due(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> bool:
        if self.save_steps is not None:
            return state.global_step % self.save_steps == 0 or state.global_step >= state.max_steps
        return bool(control.should_save)

    def _trigger(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, kwargs: Any
    ) -> None:
        if self.engine is None or not self._due(args, state, control):
            return
        if not self.hf_checkpoints:
            control.should_save = False  # this callback writes the checkpoint; HF need not
        if state.global_step in (self._last_saved, self._pending):
            return
        if control.should_evaluate:
            self._pending = state.global_step  # save once on_evaluate has the metrics
        else:
            self._save(state, kwargs, metrics=None)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The model is still at the pending step here (the optimizer has not stepped again).
        if self._pending is not None:
            self._save(state, kwargs, metrics=None)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # After a resume the Trainer counts epochs from 0 again (its epoch loop variable is not
        # reachable from a callback); shift it so logs and saved states go on from the resumed
        # epoch. The data loader restarted too, so the resumed run counts as a new epoch.
        state.epoch = (state.epoch or 0.0) + self._epoch_offset
        self._trigger(args, state, control, kwargs)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._trigger(args, state, control, kwargs)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._eval_metrics = _numeric(metrics)
        self._eval_step = state.global_step
        if self._pending == state.global_step and self.engine is not None:
            self._save(state, kwargs, metrics=self._eval_metrics)

    # -- save / load -----------------------------------------------------------------------

    def _state(self, state: TrainerState | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        model = kwargs.get("model")
        if model is None:
            raise CheckpointError("the Trainer passed no model to the callback; cannot checkpoint")
        out: dict[str, Any] = {"model": model}
        if kwargs.get("optimizer") is not None:
            out["optimizer"] = kwargs["optimizer"]
        if kwargs.get("lr_scheduler") is not None:
            out["scheduler"] = kwargs["lr_scheduler"]
        # TrainerState as HF writes it to trainer_state.json; a plain string round-trips exactly.
        text = json.dumps(dataclasses.asdict(state), sort_keys=True) if state is not None else ""
        out["trainer_state"] = {"json": text}
        out["rng"] = _rng_state()
        return out

    def _save(
        self, state: TrainerState, kwargs: Mapping[str, Any], metrics: Mapping[str, float] | None
    ) -> None:
        assert self.engine is not None
        step = self._pending if self._pending is not None else state.global_step
        self._pending = None
        if step == self._last_saved:
            return
        if metrics is None and self._eval_step == step:
            metrics = self._eval_metrics
        handle = self.engine.save(step, self._state(state, kwargs), metrics=metrics or None)
        self.handles.append(handle)
        self._last_saved = step

    def _load(
        self, engine: SyncCheckpointEngine, state: TrainerState, kwargs: Mapping[str, Any]
    ) -> int | None:
        target = self._state(None, kwargs)
        if self.resume is True:
            step = engine.load_latest(target)
            if step is None:
                return None
        else:
            step = engine.load(target, step=int(self.resume))
        saved = json.loads(target["trainer_state"]["json"])
        for name in _RESTORED_STATE_FIELDS:
            if name in saved:
                setattr(state, name, saved[name])
        self._epoch_offset = math.ceil(saved.get("epoch") or 0.0)
        _set_rng_state(target["rng"])
        # The saved step is protected by the engine until a newer one commits.
        return step

    def _load_best(
        self, args: TrainingArguments, engine: SyncCheckpointEngine, model: torch.nn.Module
    ) -> None:
        mode = "max" if args.greater_is_better else "min"
        best = KeepBest(1, _metric_name(args.metric_for_best_model or "loss"), mode)
        chosen = best.keep(engine.list_checkpoints())
        if not chosen:
            return  # no checkpoint carries the metric (no evaluation at a save step)
        self.best_step = max(chosen)
        load_checkpoint(self.root, model, step=self.best_step)
