"""Hugging Face safetensors export of a committed checkpoint.

RL frameworks publish the policy as a Hugging Face model directory every few steps (SkyRL's
``hf_save_interval`` writes ``{export_path}/global_step_{N}/policy/``) so that evaluation jobs,
inference servers and the Hub can pick it up. Doing that in the trainer means gathering the
full weights on rank 0 and writing gigabytes while every GPU waits. Once a step is committed
the same weights are on disk already, so the background worker can read them back from there
(no process group needed: DCP consolidates shards written by any number of ranks into full
tensors) and write the export while training goes on.

The building blocks, used by the worker after a step commits:

- ``HFExport``: what to export (a sub-dict of the saved state), where, how often, in what
  dtype, how many to keep;
- ``read_full_state``: the named sub-dict of a committed step as full CPU tensors, after the
  manifest checksums of every file read have been verified;
- ``write_safetensors``: ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` plus
  ``model.safetensors.index.json``, exactly as ``transformers`` writes them, published
  atomically (temporary sibling directory, fsync, rename) with a manifest of CRC-32C checksums;
- ``export_step``: both, shard by shard (at most one shard's tensors in memory at a time);
- ``exports_to_delete`` / ``prune_exports``: keep the newest N exports, remove crashed leftovers.

The export holds the tensors only: ``config.json``, the tokenizer and the generation config are
the caller's to add (``config.save_pretrained(export_dir)``), after the export or into the
directory the worker publishes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncckpt import faults
from asyncckpt.core import layout as _layout
from asyncckpt.core.paths import is_url
from asyncckpt.errors import CorruptCheckpoint
from asyncckpt.retention import KeepLast
from asyncckpt.storage import localfs
from asyncckpt.storage.base import FaultPoints, StoredCheckpoint
from asyncckpt.storage.commit import (
    new_token,
    publish,
    publish_replacing,
    remove_tree,
    write_synced,
)
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.manifest import (
    build_manifest,
    fsync_dir,
    fsync_file,
    read_manifest,
    write_manifest,
)
from asyncckpt.storage.prune import prune
from asyncckpt.worker.export_source import (
    UnknownComponent,
    _flatten,
    _open_source,
    _PtSource,
    _Source,
    _Tensor,
    read_full_state,
)

__all__ = [
    "EXPORT_FORMAT",
    "HFExport",
    "UnknownComponent",
    "export_dir",
    "export_step",
    "exports_to_delete",
    "missing_exports",
    "parse_size",
    "prune_exports",
    "read_full_state",
    "write_safetensors",
]

log = logging.getLogger("asyncckpt.worker.export")

#: The ``format`` recorded in an export's manifest.
EXPORT_FORMAT = "hf_safetensors"
#: transformers' names (``SAFE_WEIGHTS_NAME``, ``SAFE_WEIGHTS_INDEX_NAME``).
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_FILENAME_PATTERN = "model{suffix}.safetensors"

#: HF size units: decimal as ``huggingface_hub.parse_size_to_int`` (``"5GB"`` is 5 * 10**9),
#: plus the binary ones it lacks (``"1GiB"`` is 2**30).
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*$")


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int (bytes) or an HF-style string (``"500MB"``, ``"5GB"``,
    ``"1GiB"``); ``ValueError`` naming it otherwise."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"max_shard_size must be an int or a string like '5GB', not {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE_RE.match(size)
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if m is None or unit is None:
            raise ValueError(
                f"max_shard_size {size!r} is not a size: expected an int (bytes) or a number "
                f"with a unit, one of {', '.join(u.upper().replace('I', 'i') for u in _UNITS)}"
            )
        value = int(float(m.group(1)) * unit)
    if value < 1:
        raise ValueError(f"max_shard_size {size!r} must be at least 1 byte")
    return value


def _check_rel(value: str, what: str) -> list[str]:
    parts = value.split("/")
    if (
        not value
        or value.startswith("/")
        or "\\" in value
        or any(p in ("", ".", "..") for p in parts)
        or any(_layout.is_leftover(p) for p in parts)
    ):
        raise ValueError(
            f"{what} {value!r} must be a plain relative path (no '..', no leading '/', no empty "
            "parts, no '.tmp-'/'.trash-' names)"
        )
    return parts


@dataclass(frozen=True)
class HFExport:
    """Export the sub-dict ``component`` of every ``every_steps``-th committed step.

    ``component`` is a dotted path into the saved state: ``"model"`` for
    ``save(step, {"model": model.state_dict(), "optimizer": ...})``, ``"policy.model"`` for
    ``{"policy": {"model": ...}}``. In a checkpoint of components (``components=``) the first
    segment(s) name the component (``"policy.model"`` is the group member ``policy.model``, or
    the key ``model`` of component ``policy``), the rest a sub-dict of it.

    ``path`` is the export root; step N goes to ``{path}/global_step_{N}/{dirname}`` (see
    ``export_dir``). ``dirname`` defaults to ``component`` with dots as slashes; SkyRL's
    layout (``{export_path}/global_step_{N}/policy/``) is ``HFExport(..., component=
    "policy.model", dirname="policy")``.

    ``max_shard_size``: bytes per ``.safetensors`` file, an int or ``"500MB"``/``"5GB"``
    (decimal, as transformers) or ``"1GiB"`` (binary). ``keep``: the newest N exports are kept
    by ``prune_exports`` (None: all). ``dtype``: floating-point tensors are cast to it (integer
    and bool buffers keep theirs, as ``from_pretrained(torch_dtype=...)`` does).
    """

    every_steps: int
    path: str | os.PathLike
    component: str = "model"
    max_shard_size: int | str = "5GB"
    keep: int | None = None
    dtype: torch.dtype | None = None
    dirname: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every_steps, bool) or not isinstance(self.every_steps, int):
            raise TypeError(f"every_steps must be an int >= 1, not {self.every_steps!r}")
        if self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        if self.keep is not None and (
            isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1
        ):
            raise ValueError(f"keep must be an int >= 1 or None (keep all), got {self.keep!r}")
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise TypeError(f"path must be a non-empty path, not {self.path!r}")
        if is_url(self.path):  # it would become a local directory "s3:"
            from asyncckpt.errors import UnsupportedStorage

            raise UnsupportedStorage(
                f"HFExport path {os.fspath(self.path)}: exports go to a local or mounted "
                "directory; object storage is not supported for exports (a remote tier is, for "
                "checkpoints: RemoteTier)"
            )
        if not isinstance(self.component, str) or not self.component.strip():
            raise ValueError(f"component must be a non-empty dotted path, not {self.component!r}")
        segments = self.component.split(".")
        if any(not s or "/" in s or "\\" in s for s in segments):
            raise ValueError(
                f"component {self.component!r} must be dotted keys ('model', 'policy.model'): "
                "no empty segments ('..'), no '/'"
            )
        _check_rel(self.dirname or self.component.replace(".", "/"), "dirname")
        parse_size(self.max_shard_size)
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, not {self.dtype!r}")

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)

    @property
    def relpath(self) -> str:
        """The export's directory under ``global_step_N``."""
        return self.dirname or self.component.replace(".", "/")

    def due(self, step: int) -> bool:
        """Whether ``step`` is exported (every ``every_steps``-th, step 0 included)."""
        return step % self.every_steps == 0


def _step_dir_name(step: int) -> str:
    return _layout.dir_name("global_step", step)


def export_dir(export: HFExport, step: int) -> Path:
    """``{path}/global_step_{step}/{dirname}``, ``dirname`` defaulting to the component with
    dots as slashes (``model``, ``policy/model``).

    SkyRL's convention is ``{export_path}/global_step_{N}/policy/`` (its trainer's
    ``save_models``); the step directory is named as in the checkpoint root so that one step's
    checkpoint and export are found under the same name. ``dirname`` picks the last part.
    """
    return Path(export.path) / _step_dir_name(step) / export.relpath


# ---------------------------------------------------------------------------------- reading


# ---------------------------------------------------------------------------------- writing


def _require_safetensors() -> tuple[Any, Any]:
    try:
        from huggingface_hub import split_torch_state_dict_into_shards
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(
            f"safetensors export needs safetensors and huggingface_hub ({e}); install "
            "asyncckpt[hf] or `pip install safetensors huggingface_hub`"
        ) from e
    return save_file, split_torch_state_dict_into_shards


def _plan(entries: Mapping[str, _Tensor], max_shard_bytes: int) -> tuple[dict[str, list], int]:
    """(file -> names, total bytes): huggingface_hub's split, as ``save_pretrained`` uses it.

    Planned on meta tensors, so it needs no data: in order, a new file when the next tensor
    would overflow this one, a tensor larger than the limit in a file of its own.
    """
    _, split = _require_safetensors()
    meta = {n: torch.empty(e.shape, dtype=e.dtype, device="meta") for n, e in entries.items()}
    plan = split(meta, filename_pattern=_FILENAME_PATTERN, max_shard_size=max_shard_bytes)
    return dict(plan.filename_to_tensors), int(plan.metadata["total_size"])


def _prepare(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each with a storage of its own.

    safetensors refuses tensors that share memory. Tied weights (``lm_head.weight`` and
    ``transformer.wte.weight`` in one storage, as ``model.state_dict()`` gives them) are
    *cloned*, not dropped as ``save_pretrained`` drops them: the export then holds every name
    of the saved state dict, the same whether it was read from a ``pt`` file (storage shared)
    or from DCP (never shared), and any reader finds every weight; transformers re-ties them
    on load as its config says.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise TypeError(f"{name!r} is a {t.layout} tensor; safetensors holds dense tensors")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if t.numel() and (key in seen or storage.nbytes() != t.nbytes):
            t = t.clone()  # a tied weight, or a view of a larger storage
        elif t.numel():
            seen.add(key)
        out[name] = t
    return out


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    header = {"format": "pt"}  # transformers refuses a file whose header lacks it
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        header[k] = v
    return header


def _leftover_re(name: str) -> re.Pattern[str]:
    """A temporary or trash entry of the export named ``name`` (``new_token``: 12 hex)."""
    # Named by layout.tmp_name_of/trash_name ("-" as "_"); earlier releases kept the "-".
    escaped = "|".join(sorted({re.escape(name), re.escape(name.replace("-", "_"))}))
    escaped = f"(?:{escaped})"
    prefixes = f"(?:{re.escape(_layout.TMP_PREFIX)}|{re.escape(_layout.TRASH_PREFIX)})"
    return re.compile(f"^{prefixes}{escaped}-[0-9a-f]{{12}}$")


class _ExportStore(LocalStore):
    """A directory of the export root as a store: a local store without fault points (an
    export must not consume the checkpoint commit's ``before_rename``), whose ``seal`` makes
    every directory made under the temporary durable, deepest first."""

    points = FaultPoints(publish=None, tracker=None, retire=None)

    def seal(self, staged: Path, name: str, on_file: Callable[[int], None] | None = None) -> int:
        dirs = [Path(d) for d, _, _ in os.walk(staged, followlinks=False)]
        for d in reversed(dirs):
            fsync_dir(d)
        return 0


class _Staged:
    """A temporary sibling of the topmost directory of ``final`` that does not exist yet
    (``LocalStore.stage`` of its parent), locked (``flock``) while it is written so that
    ``prune_exports`` can tell a crashed export's leftover from one in flight; published
    through the commit order (``commit.publish``, ``commit.publish_replacing``).

    Staging at the topmost missing directory (``global_step_N`` itself when no export of that
    step exists yet), not beside ``final``: a crash mid-export must leave no empty
    ``global_step_N/`` or ``global_step_N/<component>/`` that a watcher of the export root
    (SkyRL's ``{export_path}/global_step_N/policy/``) would take for an export. ``base``: the
    directory never staged itself (the export root), made if missing.
    """

    def __init__(self, final: Path, base: Path | None = None) -> None:
        self.final = final
        if base is not None:
            localfs.makedirs_synced(base)
        top = final
        while top.parent != base and top.parent != top and not os.path.lexists(top.parent):
            top = top.parent
        localfs.makedirs_synced(top.parent)
        self.top = top
        self.store = _ExportStore(top.parent)
        self.tmp = self.store.stage(top.name)
        self.dir = self.tmp.joinpath(*final.relative_to(top).parts)  # where the files go
        self._fd: int | None = None
        try:
            self._fd = localfs.lock_dir(self.tmp)
            localfs.makedirs(self.dir)
        except BaseException:
            self.abort()
            raise

    def publish(self) -> None:
        """Seal and publish, replacing an export of the same step (``publish_replacing``: the
        old one goes to trash first; a crash between the two renames leaves no export of that
        step, the checkpoint is still there to export again, never a mix)."""
        if self.top != self.final:
            self._publish_new()
            return

        publish_replacing(self.store, self.tmp, self.final.name)
        self.close()

    def _publish_new(self) -> None:
        """``self.top`` was missing: publish the whole chain. If a directory of it appeared
        meanwhile (another component's export of the same step), go one level down."""

        store, src, name = self.store, self.tmp, self.top.name
        while True:
            try:
                publish(store, src, name)
                break
            except FileExistsError:
                if store.root / name == self.final:
                    raise
                (child,) = os.listdir(src)  # one directory per level down to the export
                store, src, name = _ExportStore(store.root / name), src / child, child
        self.close()
        if src != self.tmp:
            self.store.discard(self.tmp)  # the emptied levels above

    def close(self) -> None:
        if self._fd is not None:
            localfs.unlock(self._fd)
            self._fd = None

    def abort(self) -> None:
        self.close()
        try:
            self.store.discard(self.tmp)
        except OSError as e:
            log.warning("asyncckpt: could not remove the failed export %s: %s", self.tmp, e)


def _write(
    source: _Source,
    entries: Mapping[str, _Tensor],
    out_dir: Path,
    max_shard_bytes: int,
    metadata: Mapping[str, str] | None,
    *,
    dtype: torch.dtype | None,
    step: int | None,
    manifest_extra: Mapping[str, Any] | None,
    base: Path | None = None,
) -> dict[str, Any]:
    save_file, _ = _require_safetensors()
    if not entries:
        raise ValueError(f"nothing to export into {out_dir}: no tensors")
    header = _check_metadata(metadata)
    files, total = _plan(entries, max_shard_bytes)
    weight_map = {name: f for f, names in files.items() for name in names}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    staged = _Staged(out_dir, base)
    try:
        for filename, names in files.items():
            tensors = source.read(names)
            if dtype is not None:
                tensors = {n: _cast(t, dtype) for n, t in tensors.items()}
            path = staged.dir / filename
            save_file(_prepare(tensors), str(path), metadata=header)
            del tensors  # one shard's tensors in memory at a time
            fsync_file(path)
            faults.point("mid_export")
        if len(files) > 1:
            # transformers' own bytes: sorted keys, indent 2, a final newline.
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            write_synced(staged.dir / INDEX_NAME, text.encode())
        extra = {"total_size": total, "shards": len(files), **dict(manifest_extra or {})}
        manifest = build_manifest(
            staged.dir, step=-1 if step is None else step, layout="global_step",
            fmt=EXPORT_FORMAT, metrics=None, run_id=str(extra.pop("run_id", "")), extra=extra,
        )  # fmt: skip
        write_manifest(staged.dir, manifest)
        staged.publish()
    except BaseException:
        staged.abort()
        raise
    return index


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Only floating-point tensors: integer and bool buffers (position ids, masks) keep theirs.
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def write_safetensors(
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    max_shard_bytes: int,
    metadata: Mapping[str, str] | None = None,
    *,
    step: int | None = None,
    manifest_extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``tensors`` as a Hugging Face safetensors model into ``out_dir``; returns the index.

    One file ``model.safetensors`` when everything fits in ``max_shard_bytes``, otherwise
    ``model-00001-of-0000N.safetensors``... and ``model.safetensors.index.json``
    (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), split by
    ``huggingface_hub.split_torch_state_dict_into_shards`` as ``save_pretrained`` does. Every
    file's header says ``{"format": "pt"}`` (plus ``metadata``). Tensors are made contiguous
    CPU tensors; tensors that share storage (tied weights) are cloned, so every name is kept.

    Atomic: written into a temporary sibling directory, every file fsynced, a manifest with
    the CRC-32C of every file added (``asyncckpt.storage.manifest.check_dir(out_dir)`` verifies it),
    then renamed to ``out_dir``. An existing ``out_dir`` (the same step exported again, e.g.
    after a run resumed from an older checkpoint) is replaced: the new export is complete
    before the old one is moved to trash and removed. The returned index has the same shape
    as the index file, also for a single file (which has no index file, as in transformers).
    """
    max_shard_bytes = parse_size(max_shard_bytes)
    prepared = _prepare(tensors)  # the plan counts each tensor's own bytes
    entries = {n: _Tensor(tuple(t.shape), t.dtype) for n, t in prepared.items()}
    return _write(
        _PtSource(prepared, []), entries, Path(out_dir), max_shard_bytes, metadata,
        dtype=None, step=step, manifest_extra=manifest_extra,
    )  # fmt: skip


def export_step(export: HFExport, step_dir: str | os.PathLike, step: int) -> Path:
    """Export ``export.component`` of the committed step ``step_dir`` to
    ``export_dir(export, step)``; returns that directory.

    ``read_full_state`` and ``write_safetensors`` (with the optional dtype cast), one shard at a
    time: at most one shard's tensors are in memory, however large the model. The source's
    checksums are verified before anything is written; a failure leaves no export directory.
    """
    step_dir = Path(step_dir)
    out = export_dir(export, step)
    out_real, step_real = out.resolve(), step_dir.resolve()
    if out_real == step_real or step_real in out_real.parents:
        raise ValueError(f"the export {out} would be written inside the checkpoint {step_dir}")
    source = _open_source(step_dir, export.component)
    if source.skipped:
        log.debug("export of %r: skipped non-tensor leaves %s", export.component, source.skipped)
    entries = {
        n: _Tensor(e.shape, export.dtype if export.dtype and e.dtype.is_floating_point else e.dtype)
        for n, e in source.entries.items()
    }
    manifest = source.manifest or {}
    extra = {
        "component": export.component,
        "source": str(step_dir),
        "run_id": manifest.get("run_id", ""),
        "dtype": None if export.dtype is None else str(export.dtype),
    }
    _write(
        source, entries, out, export.max_shard_bytes, None,
        dtype=export.dtype, step=step, manifest_extra=extra, base=Path(export.path),
    )  # fmt: skip
    log.info("asyncckpt: exported step %d (%s) to %s", step, export.component, out)
    return out


# ---------------------------------------------------------------------------------- pruning


def exports_to_delete(steps: Iterable[int], keep: int | None) -> set[int]:
    """The steps to delete so that the newest ``keep`` remain (None: keep all)."""
    if keep is None:
        return set()
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
    ordered = sorted(set(steps))
    return set(ordered[: max(0, len(ordered) - keep)])


def _real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _parent_in_step(step_dir: Path, rel: list[str]) -> Path | None:
    """The export's parent directory inside ``step_dir``, if every level of it is a real
    directory (a symlink anywhere on the way is never followed)."""
    p = step_dir
    for part in rel[:-1]:
        p = p / part
        if not _real_dir(p):
            return None
    return p


def _remove(path: Path) -> bool:
    try:
        remove_tree(path)
    except FileNotFoundError:
        return False  # removed meanwhile (another pruner)
    return True


def _remove_leftover(path: Path) -> None:
    if not localfs.locked_elsewhere(path) and _remove(path):
        log.info("asyncckpt: removed the leftover %s", path)


def _remove_empty(step_dir: Path, rel: list[str]) -> None:
    """rmdir the directories on the way to an export that is not there, deepest first, up to
    ``global_step_N`` itself: only empty ones (anything else there is someone else's)."""
    chain = [step_dir.joinpath(*rel[:i]) for i in range(len(rel) - 1, -1, -1)]
    for p in chain:
        if not _real_dir(p):
            continue
        if not localfs.rmdir_if_empty(p):
            break  # not empty: kept, and so is every level above it
        log.info("asyncckpt: removed the empty %s (an export that never completed)", p)


def wanted_record(export: HFExport) -> dict[str, str]:
    """What a checkpoint's manifest records of the export due at its step (``hf_export``):
    the worker writes it before the commit, so an export the worker did not live to finish
    is found at its next start (``missing_exports``)."""
    return {"path": os.path.abspath(os.fspath(export.path)), "dir": export.relpath}


def missing_exports(
    export: HFExport, root: str | os.PathLike, layout: str
) -> list[tuple[int, Path]]:
    """Committed steps of ``root`` whose manifest records ``export`` as wanted and whose
    export is not in place, newer than the newest export present (older ones may have been
    pruned by ``keep``): (step, checkpoint directory), oldest first."""
    try:
        steps = [_layout.parse_dir_name("global_step", n) for n in os.listdir(export.path)]
    except FileNotFoundError:
        steps = []
    exported = [
        s
        for s in steps
        if s is not None
        and _real_dir(export_dir(export, s))
        and (export_dir(export, s) / _layout.MANIFEST).is_file()
    ]
    newest = max(exported, default=None)
    out = []
    want = wanted_record(export)
    for c in _layout.scan(root, layout):
        if newest is not None and c.step <= newest:
            continue
        try:
            manifest = read_manifest(c.path)
        except (CorruptCheckpoint, OSError):
            continue
        if manifest.get("hf_export") == want:
            out.append((c.step, c.path))
    return out


def prune_exports(export: HFExport, just_exported: int | None = None) -> list[Path]:
    """Delete all but the newest ``export.keep`` exports; returns the directories deleted.

    An export counts if ``{path}/global_step_{N}/{dirname}`` is a real directory holding an
    export manifest. Each is first renamed to a trash sibling (out of the namespace at once),
    then removed without following symlinks; a ``global_step_N`` left empty is removed too.
    Nothing outside the export root and nothing but this export's directories is touched:
    other files, other components' exports and other names are left alone. Temporaries and
    trash of this export left by a crash are removed; a temporary still locked by an export in
    flight is not.

    The deletions go through the one pruner (``prune.prune``), with its safety rules: a kept
    export must verify against its manifest before any is deleted (``just_exported``, the step
    just written and checksummed as it was, counts as verified unread), else the newest that
    verifies is kept too, and nothing is deleted if none does.
    """
    root = Path(export.path)
    rel = export.relpath.split("/")
    name = rel[-1]
    found: dict[int, Path] = {}
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    # An export staged as a whole step directory (no export of that step existed yet).
    step_leftover = re.compile(
        f"^(?:{re.escape(_layout.TMP_PREFIX)}|{re.escape(_layout.TRASH_PREFIX)})"
        r"global_step_\d+-[0-9a-f]{12}$"
    )
    for entry in entries:
        if step_leftover.match(entry.name):
            _remove_leftover(root / entry.name)
    for entry in entries:
        step = _layout.parse_dir_name("global_step", entry.name)
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        step_dir = Path(entry.path)
        # Leftovers at each level (staged at the topmost level that was missing), and the
        # empty directories an interrupted export of an older version left on the way.
        p = step_dir
        for part in rel:
            if not _real_dir(p):
                break
            leftover = _leftover_re(part)
            for child in sorted(os.listdir(p)):
                if leftover.match(child):
                    _remove_leftover(p / child)
            p = p / part
        parent = _parent_in_step(step_dir, rel)  # no symlink on the way is followed
        if parent is None:
            _remove_empty(step_dir, rel)  # (rmdir of real, empty directories only)
            continue
        target = parent / name
        if _real_dir(target) and (target / _layout.MANIFEST).is_file():
            found[step] = target
        elif not os.path.lexists(target):
            _remove_empty(step_dir, rel)
    if export.keep is None or not found:
        return []
    exports_to_delete(found, export.keep)  # (checks keep)

    view = _Exports(root, found, len(rel))
    trusted = () if just_exported is None else (just_exported,)
    result = prune(
        view, "global_step", KeepLast(export.keep), allow_tracker_lag=True, trusted=trusted,
        warn=False,
    )  # fmt: skip
    for step, problems in result.corrupt.items():
        log.warning("asyncckpt: the export of step %d fails its manifest: %s", step, problems)
    removed = [found[s] for s in result.deleted]
    if removed:
        fsync_dir(root)
    return removed


class _Exports(LocalStore):
    """The exports of one ``HFExport`` as a store, for the one pruner (``prune.prune``): each
    ``global_step_N/<dirname>`` that holds an export manifest is a checkpoint of step N. No
    tracker and no fault point; a deletion is a rename to a trash sibling, then the removal,
    then ``rmdir`` of the levels it left empty up to ``global_step_N``."""

    points = FaultPoints(publish=None, tracker=None, retire=None)

    def __init__(self, root: Path, found: dict[int, Path], depth: int) -> None:
        super().__init__(root)
        self.found = found
        self.depth = depth

    def committed(self, layout: str) -> list[StoredCheckpoint]:
        return [
            StoredCheckpoint(s, self.found[s].relative_to(self.root).as_posix())
            for s in sorted(self.found)
        ]

    def read_tracker(self) -> int | None:
        return None

    def retire(self, name: str) -> Path:
        target = self.root / name
        trash = target.parent / f"{_layout.TRASH_PREFIX}{target.name}-{new_token()}"
        localfs.rename(target, trash)  # FileNotFoundError: pruned meanwhile
        fsync_dir(target.parent)
        return trash

    def reclaim(self, retired: Path) -> None:
        _remove(retired)
        # Directories left empty, up to global_step_N (never the export root itself).
        for p in [retired.parent, *retired.parent.parents][: self.depth]:
            if not localfs.rmdir_if_empty(p):
                break  # not empty (another component's export, other files): kept


def check_source(state: Any, component: str) -> None:
    """Raise before a save is staged if ``state`` has no tensors at ``component`` (a typo'd
    export would otherwise fail only after the step committed, in the worker)."""
    node = state
    walked: list[str] = []
    for segment in component.split("."):
        if not isinstance(node, Mapping) or segment not in node:
            keys = sorted(map(str, node)) if isinstance(node, Mapping) else []
            where = ".".join(walked) or "the saved state"
            raise ValueError(
                f"HFExport component {component!r}: {where} has no key {segment!r} "
                f"(it has {keys}); nothing was saved"
            )
        node = node[segment]
        walked.append(segment)
    if hasattr(node, "state_dict") and callable(node.state_dict):
        node = node.state_dict()  # a module or optimizer, saved through its state dict
    leaves: dict[str, Any] = {}
    _flatten(node, component, leaves)
    if not any(isinstance(v, torch.Tensor) for v in leaves.values()):
        raise ValueError(f"HFExport component {component!r} holds no tensors; nothing was saved")
