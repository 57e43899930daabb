"""Lightning integration: an asynchronous ``CheckpointIO`` plugin and a ``ModelCheckpoint``.

``pip install "asyncckpt[lightning]"``. Lightning is imported by this module only.

- ``AsyncCheckpointIO``: Lightning's ``CheckpointIO`` contract on an asyncckpt engine.
  ``save_checkpoint`` returns once the checkpoint dict is staged; the background worker writes,
  commits and prunes; ``teardown`` (end of ``fit``, also after an exception) waits for every
  staged save to commit and stops the worker. A Lightning path ``<dir>/<name>.ckpt`` becomes the
  asyncckpt checkpoint ``<dir>/global_step_<checkpoint["global_step"]>`` (root ``<dir>``).
- ``load_from_checkpoint(Model, path)``: ``Model.load_from_checkpoint(path)`` for an asyncckpt
  checkpoint (Lightning's own reads ``path`` as one file; an asyncckpt checkpoint is a
  ``global_step_N`` directory).
- ``AsyncModelCheckpoint``: ``ModelCheckpoint``'s triggers (``every_n_train_steps``,
  ``train_time_interval``, ``every_n_epochs``, validation end, ``save_last``) with asyncckpt's
  retention: ``save_top_k`` / ``monitor`` / ``mode`` / ``save_last`` map to
  ``KeepBest(save_top_k, monitor, mode) | KeepLast(1)`` (see ``retention_policy``), pruned by the
  worker after each commit. It installs ``AsyncCheckpointIO`` on the trainer when the trainer
  has another plugin, and makes ``trainer.fit(ckpt_path="last")`` resume from the newest
  checkpoint that loads (falling back, loudly, past a corrupt one).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
import threading
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"asyncckpt.integrations.lightning needs lightning>=2.4 ({e}): "
        "pip install 'asyncckpt[lightning]'"
    ) from e

from asyncckpt.core import layout as _layout
from asyncckpt.errors import CheckpointError, CorruptCheckpoint
from asyncckpt.formats.reading import read_checkpoint
from asyncckpt.options import Distributed, Preemption
from asyncckpt.retention import KeepBest, KeepLast, RetentionPolicy
from asyncckpt.storage.prune import trash_and_delete
from asyncckpt.sync import SyncCheckpointEngine
from asyncckpt.trainer.supervisor import wait_for_orphaned_workers

log = logging.getLogger("asyncckpt")

__all__ = ["AsyncCheckpointIO", "AsyncModelCheckpoint", "load_from_checkpoint", "retention_policy"]


def retention_policy(
    save_top_k: int = 1,
    monitor: str | None = None,
    mode: str = "min",
    save_last: bool | str | None = None,
) -> RetentionPolicy | None:
    """The asyncckpt policy for ``ModelCheckpoint``'s retention arguments (None: keep all).

    - ``save_top_k=-1``: keep every checkpoint (None).
    - ``save_top_k=k > 0`` with ``monitor``: ``KeepBest(k, monitor, mode)``; without ``monitor``
      (Lightning allows only ``k == 1`` then): ``KeepLast(k)``.
    - ``save_last``: ``| KeepLast(1)``.
    - ``save_top_k=0`` saves nothing unless ``save_last`` (then ``KeepLast(1)``), as Lightning.

    asyncckpt always keeps the newest checkpoint as well (and the one the tracker names), so a
    ``KeepBest(k)`` root holds the k best plus the newest.
    """
    if save_top_k < -1:
        raise ValueError(f"save_top_k={save_top_k}: must be >= -1")
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r}: must be 'min' or 'max'")
    if save_top_k == -1:
        return None
    policy: RetentionPolicy | None = None
    if save_top_k > 0:
        policy = KeepBest(save_top_k, monitor, mode=mode) if monitor else KeepLast(save_top_k)
    if save_last:
        policy = KeepLast(1) if policy is None else policy | KeepLast(1)
    return policy if policy is not None else KeepLast(1)


def _norm(path: str | os.PathLike) -> str:
    return os.path.normpath(os.path.abspath(os.fspath(path)))


def _map_location(obj: Any, where: Any) -> Any:
    """Apply ``torch.load``'s ``map_location`` (device, str, dict or callable) to CPU tensors."""
    if where is None:
        return obj
    if isinstance(obj, torch.Tensor):
        if isinstance(where, (str, torch.device)):
            return obj.to(where)
        if isinstance(where, dict):
            target = where.get("cpu")
            return obj if target is None else obj.to(target)
        if callable(where):
            storage = where(obj.untyped_storage(), "cpu")
            device = getattr(storage, "device", None)
            return obj if device is None or device.type == "cpu" else obj.to(device)
        raise TypeError(f"map_location={where!r}: expected a device, str, dict or callable")
    if isinstance(obj, dict):
        return {k: _map_location(v, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_location(v, where) for v in obj]
    return obj


class AsyncCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves through an asyncckpt ``SyncCheckpointEngine``.

    ``Trainer(plugins=[AsyncCheckpointIO()])``. ``root``: write every checkpoint under this
    root (default: the directory of the path Lightning passes). ``keep``: the retention policy
    of roots nobody configured (default: keep all, and let the caller's ``remove_checkpoint``
    calls prune). ``engine_options``: other ``CheckpointEngine`` arguments (``throttle``,
    ``staging``, ``on_commit``, ...); ``handle_sigterm`` defaults to False, since Lightning
    handles SIGTERM itself and tears the strategy down, which drains the engine.

    Paths: a save to ``<dir>/<anything>`` writes step ``checkpoint["global_step"]`` under root
    ``<dir>`` as ``<dir>/global_step_<N>``. Each path saved is remembered (this process only) so
    ``load_checkpoint`` and ``remove_checkpoint`` of that path find the checkpoint; a second
    save at the same step (``last.ckpt`` beside ``epoch=0-step=10.ckpt``) is an alias of the
    first and writes nothing. ``load_checkpoint`` also takes, from any process, a checkpoint
    directory (``<dir>/global_step_10``) or a root (``<dir>``: the newest checkpoint that
    loads).
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        *,
        keep: RetentionPolicy | None = None,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.root = Path(root) if root is not None else None
        self.keep = keep
        # Lightning handles SIGTERM itself (its teardown drains us). Under DDP only global rank
        # 0 calls save_checkpoint, with the whole (replicated) state: it writes on its own.
        self.engine_options = _lightning_defaults(engine_options or {})
        self._roots: dict[str, dict[str, Any]] = {}  # root -> engine kwargs (configure_root)
        self._engines: dict[str, SyncCheckpointEngine] = {}
        self._paths: dict[str, tuple[str, int]] = {}  # Lightning path -> (root, step)
        self._unwanted: set[tuple[str, int]] = set()  # removed, to delete when it may go
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- configuration
    def configure_root(self, root: str | os.PathLike, **engine_kwargs: Any) -> None:
        """Engine arguments (``keep=...``) for checkpoints written under ``root``; before its
        first save."""
        key = _norm(root)
        if key in self._engines:
            raise CheckpointError(f"{root}: configure_root after its engine started")
        self._roots[key] = engine_kwargs

    def engine(self, root: str | os.PathLike) -> SyncCheckpointEngine:
        """The started engine of ``root`` (started on first use)."""
        key = _norm(root)
        with self._lock:
            engine = self._engines.get(key)
            if engine is None:
                kwargs = {"keep": self.keep, **self.engine_options, **self._roots.get(key, {})}
                engine = SyncCheckpointEngine(key, layout="global_step", **kwargs)
                engine.__enter__()
                self._engines[key] = engine
            return engine

    def locate(
        self, path: str | os.PathLike, checkpoint: dict[str, Any] | None = None
    ) -> tuple[str, int]:
        """(root, step) of a Lightning path: known, a ``global_step_N`` dir, or a new save."""
        p = _norm(path)
        if p in self._paths:
            return self._paths[p]
        name_step = _layout.parse_dir_name("global_step", os.path.basename(p))
        if name_step is not None and self.root is None:
            root = os.path.dirname(p)
        else:
            root = _norm(self.root) if self.root is not None else os.path.dirname(p)
        if checkpoint is None:
            if name_step is None:
                raise FileNotFoundError(f"{path}: not a checkpoint this plugin saved")
            return root, name_step
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(
                f"{path}: the checkpoint dict's 'global_step' is {step!r}; asyncckpt needs a step"
            )
        if name_step is not None and name_step != step:
            raise CheckpointError(f"{path} names step {name_step} but global_step is {step}")
        return root, step

    # ---------------------------------------------------------------- CheckpointIO
    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike,
        storage_options: Any | None = None,
    ) -> None:
        """Stage ``checkpoint`` and return; ``storage_options={"metrics": {...}}`` passes
        metrics to the retention policy (``KeepBest``)."""
        metrics = None
        if storage_options is not None:
            if not isinstance(storage_options, dict) or set(storage_options) - {"metrics"}:
                raise TypeError(
                    f"storage_options={storage_options!r}: AsyncCheckpointIO takes only "
                    "{'metrics': {name: number}}"
                )
            metrics = storage_options.get("metrics")
        p = _norm(path)
        previous = self._paths.pop(p, None)  # saving over a path replaces what it named
        root, step = self.locate(path, checkpoint)
        if any(v == (root, step) for v in self._paths.values()):
            # Lightning saves one step twice (top-k and last.ckpt): one checkpoint, two names.
            log.debug("%s: step %d already saved under %s; recorded as an alias", p, step, root)
        else:
            self.engine(root).save(step, checkpoint, metrics=metrics)
        self._paths[p] = (root, step)
        if previous is not None and previous != (root, step):
            self._unwanted.add(previous)
        self._collect()

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint dict saved at ``path`` (a saved path, a ``global_step_N`` directory,
        or a root: its newest checkpoint that loads). Tensors on the CPU unless
        ``map_location`` says otherwise."""
        if weights_only:
            raise CheckpointError(
                f"load_checkpoint({path!s}, weights_only=True): asyncckpt checkpoints unpickle "
                "their non-tensor entries (DCP); load only trusted checkpoints, with "
                "weights_only=False or None"
            )
        p = _norm(path)
        if p in self._paths:
            root, step = self._paths[p]
            self._drain(root)
            return _map_location(
                self._read(Path(root) / _layout.dir_name("global_step", step)), map_location
            )
        directory = Path(p)
        if directory.is_dir() and _layout.parse_dir_name("global_step", directory.name) is not None:
            self._drain(str(directory.parent))
            return _map_location(self._read(directory), map_location)
        if directory.is_dir() and _layout.scan(directory, "global_step"):
            self._drain(p)
            return _map_location(self._read_latest(directory), map_location)
        named = _named_step(directory)
        if named is not None:  # a name Lightning made for a save: its global_step_N, found here
            log.info("%s: Lightning's name for %s", path, named)
            self._drain(str(named.parent))
            return _map_location(self._read(named), map_location)
        raise FileNotFoundError(
            f"{path}: no asyncckpt checkpoint there; pass a checkpoint directory "
            "(<dir>/global_step_N), a checkpoint root (<dir>), or a path this process saved"
        )

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Forget ``path``; its checkpoint is deleted once no other saved path names it and a
        newer checkpoint has committed (asyncckpt never deletes the newest committed one)."""
        p = _norm(path)
        found = self._paths.pop(p, None)
        if found is None:
            log.debug("remove_checkpoint(%s): not a checkpoint this plugin saved", p)
            return
        self._unwanted.add(found)
        self._collect()

    def _collect(self, *, final: bool = False) -> None:
        """Delete the unwanted checkpoints that can go: no saved path names them, committed,
        and not the newest (until a newer one commits, it is the one a crash resumes from)."""

        named = set(self._paths.values())
        for root, step in sorted(self._unwanted):
            if (root, step) in named:
                self._unwanted.discard((root, step))  # named again (saved over)
                continue
            committed = [c.step for c in _layout.scan(root, "global_step")]
            newest = max(committed, default=None)
            if step not in committed:
                if final:  # never committed (a failed save): nothing to delete
                    self._unwanted.discard((root, step))
                continue
            if step == newest or step == _layout.read_tracker(root):
                continue
            try:
                trash_and_delete(root, Path(root) / _layout.dir_name("global_step", step))
            except FileNotFoundError:
                pass  # pruned by the engine's own policy already
            self._unwanted.discard((root, step))

    def teardown(self) -> None:
        """Wait for every staged save to commit, stop the engines; re-raise a failed save."""
        with self._lock:
            engines, self._engines = self._engines, {}
        error: BaseException | None = None
        for engine in engines.values():
            try:
                engine.wait()
            except BaseException as e:  # noqa: BLE001 - every engine is closed, then raised
                error = error or e
            finally:
                engine.close()
        self._collect(final=True)
        if error is not None:
            raise error

    # ---------------------------------------------------------------- reading
    def _drain(self, root: str) -> None:
        # A checkpoint saved by this process may still be in flight: reading waits for it.
        engine = self._engines.get(_norm(root))
        if engine is not None:
            engine.wait()
        else:  # a killed run's worker may still be committing what that run staged
            wait_for_orphaned_workers(root)

    def _read(self, directory: Path) -> dict[str, Any]:
        checkpoint = read_checkpoint(directory)
        log.info("loaded Lightning checkpoint %s", directory)
        return checkpoint

    def _read_latest(self, root: Path) -> dict[str, Any]:
        errors = []
        for c in reversed(_layout.scan(root, "global_step")):
            try:
                return self._read(c.path)
            except (CorruptCheckpoint, FileNotFoundError) as e:
                if not c.path.is_dir():
                    continue  # pruned while read
                errors.append(f"step {c.step}: {e}")
                msg = f"checkpoint step {c.step} at {c.path} is unusable ({e}); trying an older one"
                warnings.warn(msg, stacklevel=3)  # one channel: the caller's warning
        raise CorruptCheckpoint(f"no checkpoint in {root} could be loaded: " + "; ".join(errors))


def load_from_checkpoint(
    cls: Any,
    checkpoint_path: str | os.PathLike,
    map_location: Any | None = None,
    *,
    checkpoint_io: AsyncCheckpointIO | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, map_location, **kwargs)`` for an asyncckpt
    checkpoint: ``load_from_checkpoint(Model, checkpoint_callback.best_model_path)``.

    Lightning's ``load_from_checkpoint`` opens its path as one file (``IsADirectoryError`` on a
    ``global_step_N`` directory) and asks no ``CheckpointIO``, so a plugin cannot take it over.
    Here the checkpoint dict is read as ``AsyncCheckpointIO.load_checkpoint`` reads it (a
    ``global_step_N`` directory, or a root: its newest checkpoint that loads; a ``.ckpt`` name
    only through the ``checkpoint_io`` that saved it, e.g. ``trainer.strategy.checkpoint_io``)
    and handed to ``cls.load_from_checkpoint`` as an in-memory file, so hyperparameters,
    ``strict``, ``on_load_checkpoint`` and ``map_location`` are Lightning's own. The dict
    passes through memory twice (read, then serialised for Lightning). Works for a
    ``LightningDataModule`` too.
    """
    if kwargs.pop("weights_only", None):
        raise CheckpointError(
            f"load_from_checkpoint({checkpoint_path!s}, weights_only=True): asyncckpt "
            "checkpoints unpickle their non-tensor entries (DCP); load only trusted checkpoints"
        )
    checkpoint = (checkpoint_io or AsyncCheckpointIO()).load_checkpoint(checkpoint_path)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    # weights_only=False: the dict holds what was saved (hparams objects included), as read.
    return cls.load_from_checkpoint(buffer, map_location=map_location, weights_only=False, **kwargs)


def _named_step(path: Path) -> Path | None:
    """The checkpoint a Lightning ``.ckpt`` name stands for, from any process: the plugin
    writes ``<dir>/epoch=0-step=10.ckpt`` (``ModelCheckpoint``'s default ``filename`` holds
    ``step=``) as ``<dir>/global_step_10``, so the name alone finds it when that exists."""
    if path.suffix != ".ckpt" or path.exists():
        return None
    found = re.findall(r"(?:^|[-_])step=(\d+)", path.stem)
    if len(found) != 1:
        return None
    directory = path.parent / _layout.dir_name("global_step", int(found[0]))
    return directory if directory.is_dir() else None


def _step_of(path: str) -> int:
    step = _layout.parse_dir_name("global_step", os.path.basename(path))
    return -1 if step is None else step


class AsyncModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose saves go through asyncckpt, pruned by asyncckpt's retention.

    The triggers are Lightning's own (``every_n_train_steps``, ``train_time_interval``,
    ``every_n_epochs``, validation end, ``save_on_train_epoch_end``, ``save_last`` at the end of
    training). Each trigger writes one checkpoint ``dirpath/global_step_<N>`` (``filename`` is
    not used), with the monitored value as its metric. Retention is ``retention_policy(...)``
    (or ``keep=``, any asyncckpt policy), applied by the worker after every commit: Lightning's
    own ``best_k_models`` bookkeeping and file removal are not used.

    ``trainer.fit(model, ckpt_path="last")`` resumes from the newest checkpoint under
    ``dirpath`` that loads; ``ckpt_path=dirpath`` does the same, ``ckpt_path=".../global_step_N"``
    loads that one; ``ckpt_path="best"`` loads the best one this run saved.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_last: bool | str | None = None,
        save_weights_only: bool = False,
        save_on_train_epoch_end: bool | None = None,
        *,
        keep: RetentionPolicy | None = None,
        engine_options: dict[str, Any] | None = None,
        verbose: bool = False,
        filename: str | None = None,
    ) -> None:
        if filename is not None:
            # Ignoring it would leave the user looking for files that never appear.
            raise ValueError(
                f"AsyncModelCheckpoint(filename={filename!r}): asyncckpt names each checkpoint "
                "dirpath/global_step_<N> (the step, as the engine's retention and resume need); "
                "drop filename= (the monitored value is recorded as the checkpoint's metric)"
            )
        for name in ("_save_topk_checkpoint", "_save_last_checkpoint", "_find_last_checkpoints"):
            if not callable(getattr(ModelCheckpoint, name, None)):
                import lightning

                raise CheckpointError(
                    f"AsyncModelCheckpoint needs ModelCheckpoint.{name}, which lightning "
                    f"{lightning.__version__} lacks (tested with lightning 2.4-2.6)"
                )
        super().__init__(
            dirpath=None if dirpath is None else os.fspath(dirpath),
            monitor=monitor,
            mode=mode,
            save_top_k=save_top_k,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            save_last=save_last,  # type: ignore[arg-type]  # Lightning checks it
            save_weights_only=save_weights_only,
            save_on_train_epoch_end=save_on_train_epoch_end,
            verbose=verbose,
        )
        self.keep = (
            keep if keep is not None else retention_policy(save_top_k, monitor, mode, save_last)
        )
        self.engine_options = dict(engine_options or {})
        self.checkpoint_io: AsyncCheckpointIO | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, AsyncCheckpointIO):
            # Runs before Lightning restores ckpt_path, so the restore reads through it too.
            io = AsyncCheckpointIO(engine_options=self.engine_options)
            trainer.strategy.checkpoint_io = io
        if _norm(self._root()) not in io._engines:
            io.configure_root(self._root(), keep=self.keep, **self.engine_options)
        self.checkpoint_io = io

    def _root(self) -> str:
        # Lightning resolves a dirpath of None in ModelCheckpoint.setup (under the logger's dir).
        if self.dirpath is None:
            raise CheckpointError("AsyncModelCheckpoint has no dirpath: setup() has not run")
        return os.fspath(self.dirpath)

    # Lightning's two save paths; both write the one checkpoint of this step.
    def _save_topk_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        if self.save_top_k != 0:
            self._save_async(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        if self.save_last:
            self._save_async(trainer, monitor_candidates)

    def _save_async(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        step = trainer.global_step
        if self._last_global_step_saved == step:
            return  # top-k and last in the same hook: one checkpoint
        metrics: dict[str, float] = {}
        current = None
        if self.monitor is not None:
            current = monitor_candidates.get(self.monitor)
            if current is None:
                warnings.warn(
                    f"AsyncModelCheckpoint(monitor={self.monitor!r}) found no such metric in "
                    f"{sorted(monitor_candidates)} at step {step}; saved without it (KeepBest "
                    "does not keep it)",
                    stacklevel=2,
                )
            else:
                metrics[self.monitor] = float(current)
        filepath = os.path.join(self._root(), _layout.dir_name("global_step", step))
        self.last_model_path = filepath
        if current is not None:
            self.current_score = (
                current.detach().clone()
                if isinstance(current, torch.Tensor)
                else torch.tensor(current)
            )
            better = self.best_model_score is None or (
                bool(self.current_score < self.best_model_score)
                if self.mode == "min"
                else bool(self.current_score > self.best_model_score)
            )
            if better:
                self.best_model_path, self.best_model_score = filepath, self.current_score
            self._update_best_k(filepath, self.current_score)
        elif self.monitor is None:
            self.best_model_path = filepath
        trainer.save_checkpoint(
            filepath, self.save_weights_only, storage_options={"metrics": metrics}
        )
        self._last_global_step_saved = step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            from weakref import proxy

            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _update_best_k(self, filepath: str, score: torch.Tensor) -> None:
        """Lightning's ``best_k_models`` (path -> score) and ``kth_best_model_path`` /
        ``kth_value``: the ``save_top_k`` best this run saved (newer first among equals, as
        ``KeepBest``); the retention policy, not this bookkeeping, deletes checkpoints."""
        self.best_k_models[filepath] = score
        sign = 1.0 if self.mode == "min" else -1.0
        order = sorted(
            self.best_k_models,
            key=lambda p: (sign * float(self.best_k_models[p]), -_step_of(p)),
        )
        if self.save_top_k >= 0:
            for p in order[self.save_top_k :]:
                del self.best_k_models[p]
            order = order[: self.save_top_k]
        if order:
            self.kth_best_model_path = order[-1]
            self.kth_value = self.best_k_models[order[-1]]

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        # ckpt_path="last": the root itself; load_checkpoint picks its newest good checkpoint.
        dirpath = self.dirpath
        if dirpath is None:
            # Lightning resolves "last" before setup() sets dirpath: work out its default
            # (default_root_dir/checkpoints, or the logger's) as ModelCheckpoint does.
            resolve = getattr(self, "_ModelCheckpoint__resolve_ckpt_dir", None)
            dirpath = resolve(trainer) if resolve is not None else None
        if dirpath is None or not _layout.scan(dirpath, "global_step"):
            return set()
        return {_norm(dirpath)}


def _lightning_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """No SIGTERM handler and one rank, unless the user's options say otherwise (in the grouped
    objects, or in the deprecated flat keywords)."""
    out = dict(options)
    if "preemption" not in out and "handle_sigterm" not in out:
        out["preemption"] = Preemption(handle_sigterm=False)
    flat = {"rank", "world_size", "local_rank", "store", "dist_timeout", "storage"} & out.keys()
    given = out.get("distributed")
    if given is None and not flat:
        out["distributed"] = Distributed(world_size=1)
    elif isinstance(given, Distributed) and given.world_size is None:
        out["distributed"] = dataclasses.replace(given, world_size=1)
    elif flat and "world_size" not in out:
        out["world_size"] = 1
    return out
