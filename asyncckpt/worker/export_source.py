"""What an export reads: the named sub-dict of a committed step as full CPU tensors, from its DCP
shards or its torch.save file, each file checked against the manifest before it is read."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncckpt.errors import CorruptCheckpoint
from asyncckpt.formats.components import COMPONENTS, saved_spec
from asyncckpt.formats.loadcheck import read_error
from asyncckpt.formats.pt import read
from asyncckpt.storage.manifest import (
    check_files,
    read_manifest,
)

log = logging.getLogger("asyncckpt.worker.export")  # (the export's one log)


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    """Dotted names of the leaves of dicts and lists, as DCP names them (``a.b.0.c``)."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)) and obj:
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)
    elif prefix:
        out[prefix] = obj


def _keys_at(names: Iterable[str], segments: list[str]) -> tuple[str, list[str]]:
    """The deepest prefix of ``segments`` some name has, and the keys found right under it."""
    names = list(names)
    for depth in range(len(segments), -1, -1):
        head = ".".join(segments[:depth])
        pre = f"{head}." if head else ""
        under = sorted({n[len(pre) :].split(".", 1)[0] for n in names if n.startswith(pre)})
        if under:
            return head, under
    return "", []


class UnknownComponent(KeyError):
    """The component to export is not in the checkpoint; the message lists the keys there are."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument
        return str(self.args[0]) if self.args else ""


def _unknown(sub: str, where: str, names: Iterable[str], within: str = "") -> UnknownComponent:
    head, keys = _keys_at(names, sub.split(".") if sub else [])
    place = ".".join(p for p in (within, head) if p)
    at = f"under {place!r}" if place else "at the top level"
    wanted = ".".join(p for p in (within, sub) if p)
    more = " ..." if len(keys) > 50 else ""
    return UnknownComponent(f"{where} has no {wanted!r} to export; keys {at}: {keys[:50]}{more}")


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Source:
    """The tensors of one component of a committed step: their names, shapes and dtypes
    without reading them, then ``read(names)`` for any subset (a shard at a time)."""

    entries: dict[str, _Tensor]
    skipped: list[str]
    manifest: Mapping[str, Any] | None = None  # the step's, where read from a checkpoint

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class _DCPSource(_Source):
    """A DCP directory (plain ``dcp``, a ``dcp`` component, Megatron ``torch_dist``): DCP
    reads each requested tensor whole, assembled from the chunks every rank wrote."""

    def __init__(self, directory: Path, fqns: dict[str, str], metadata: Any) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = directory
        self.fqn = {}
        self.entries = {}
        self.skipped = []
        for name, fqn in fqns.items():
            md = metadata.state_dict_metadata[fqn]
            if isinstance(md, TensorStorageMetadata):
                self.fqn[name] = fqn
                self.entries[name] = _Tensor(tuple(md.size), md.properties.dtype)
            else:
                self.skipped.append(name)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.api import CheckpointException

        from asyncckpt.formats.dcp.reader import load_flat

        request = {
            self.fqn[n]: torch.empty(self.entries[n].shape, dtype=self.entries[n].dtype)
            for n in names
        }
        # No process group: the worker has none here, and needs none to read every chunk.
        try:
            load_flat(
                request,
                self.directory,
                planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            )
        except CheckpointException as e:
            # A BaseException: past ``except Exception`` (the worker's export redo at start)
            # and past callers of read_full_state / export_step that catch our errors.
            raise read_error(self.directory, e) from e
        return {n: request[self.fqn[n]] for n in names}


class _PtSource(_Source):
    def __init__(self, tensors: dict[str, torch.Tensor], skipped: list[str]) -> None:
        self.tensors = tensors
        self.entries = {n: _Tensor(tuple(t.shape), t.dtype) for n, t in tensors.items()}
        self.skipped = skipped

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.tensors[n] for n in names}


def _verify(step_dir: Path, manifest: Mapping[str, Any], rels: Iterable[str]) -> None:
    """The manifest's checksums of the files about to be read (CorruptCheckpoint otherwise)."""
    files = manifest.get("files", {})
    problems = []
    for rel in sorted(set(rels)):
        if rel not in files:
            problems.append(f"{rel}: not in the manifest")
            continue
        try:
            problems += check_files(step_dir, {"files": {rel: files[rel]}})
        except OSError as e:  # unreadable, or pruned while checked
            problems.append(f"{rel}: {e}")
    if problems:
        raise CorruptCheckpoint(f"{step_dir}: " + "; ".join(problems))


def _single_value(component: str, step_dir: Path) -> ValueError:
    return ValueError(
        f"{component!r} in {step_dir} is a single value (a tensor or another leaf), not a dict "
        "of tensors; name the dict that holds the model's weights"
    )


def _select(names: Iterable[str], sub: str) -> dict[str, str]:
    """Export name -> saved name, for the saved names under the dotted prefix ``sub``
    (everything when ``sub`` is empty)."""
    if not sub:
        return {n: n for n in names}
    pre = f"{sub}."
    return {n[len(pre) :]: n for n in names if n.startswith(pre)}


def _dcp_source(
    step_dir: Path, manifest: Mapping[str, Any], directory: Path, sub: str, component: str,
    within: str,
) -> _DCPSource:  # fmt: skip
    from asyncckpt.formats.dcp.metadata import read_dcp_metadata

    rel = directory.relative_to(step_dir).as_posix()
    prefix = "" if rel == "." else f"{rel}/"
    # .metadata is a pickle: checked before it is unpickled.
    _verify(step_dir, manifest, [f"{prefix}.metadata"])
    metadata = read_dcp_metadata(directory)
    fqns = _select(metadata.state_dict_metadata, sub)
    if sub in metadata.state_dict_metadata:
        raise _single_value(component, step_dir)
    if not fqns:
        raise _unknown(sub, str(step_dir), metadata.state_dict_metadata, within)
    source = _DCPSource(directory, fqns, metadata)
    if not source.entries:
        raise ValueError(f"{component!r} in {step_dir} holds no tensors (only other values)")
    wanted = set(source.fqn.values())
    files = {
        f"{prefix}{info.relative_path}"
        for index, info in metadata.storage_data.items()
        if index.fqn in wanted
    }
    _verify(step_dir, manifest, files)
    return source


def _pt_source(
    step_dir: Path, manifest: Mapping[str, Any], rel: str, sub: str, component: str, within: str
) -> _PtSource:
    _verify(step_dir, manifest, [rel])

    # Tensors, containers and plain values only, whatever the component says: the export
    # reads weights, and never runs a pickle's code.
    try:
        obj = read(step_dir / rel, weights_only=True, mmap=True)
    except Exception as e:
        raise CorruptCheckpoint(f"{step_dir / rel}: cannot read with weights_only=True: {e}") from e
    flat: dict[str, Any] = {}
    _flatten(obj, "", flat)
    if sub in flat:
        raise _single_value(component, step_dir)
    picked = _select(flat, sub)
    if not picked:
        raise _unknown(sub, str(step_dir), flat, within)
    tensors = {n: flat[s] for n, s in picked.items() if isinstance(flat[s], torch.Tensor)}
    if not tensors:
        raise ValueError(f"{component!r} in {step_dir} holds no tensors (only other values)")
    return _PtSource(tensors, [n for n in picked if n not in tensors])


def _open_source(step_dir: str | os.PathLike, component: str) -> _Source:
    """Find ``component`` in the committed step ``step_dir`` and verify what it will read."""
    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir)  # CorruptCheckpoint when there is none
    source = _find_source(step_dir, manifest, component)
    source.manifest = manifest
    return source


def _find_source(step_dir: Path, manifest: Mapping[str, Any], component: str) -> _Source:

    fmt = manifest.get("format")
    if fmt != COMPONENTS:
        if fmt in ("dcp", "torch_dist"):
            return _dcp_source(step_dir, manifest, step_dir, component, component, "")
        raise NotImplementedError(
            f"{step_dir} is in format {fmt!r}; export reads dcp and torch_dist checkpoints "
            "(and dcp, torch_dist and pt components)"
        )
    spec = saved_spec(manifest, {})
    segments = component.split(".")
    # The longest component name the dotted path starts with (a group member "policy.model"
    # before a component "policy"); the rest is a sub-dict of that component's state.
    match = None
    for k in range(len(segments), 0, -1):
        if ".".join(segments[:k]) in spec:
            match = ".".join(segments[:k])
            sub = ".".join(segments[k:])
            break
    if match is None:
        members = [n for n in spec if n.startswith(f"{component}.")]
        if members:
            raise ValueError(
                f"{component!r} in {step_dir} is a group of components {members}; name the one "
                f"holding the model (e.g. {members[0]!r})"
            )
        raise UnknownComponent(
            f"{step_dir} has no component {component!r} to export; its components: {list(spec)}"
        )
    c = spec[match]
    step = int(manifest.get("step", -1))
    world_size = int(manifest.get("world_size", 1) or 1)
    if c.format in ("dcp", "torch_dist"):
        directory = step_dir / c.resolve(match, step, 0, world_size)
        return _dcp_source(step_dir, manifest, directory, sub, component, match)
    if c.format == "pt":
        if c.per_rank and world_size > 1:
            raise NotImplementedError(
                f"component {match!r} of {step_dir} is one pt file per rank ({world_size} "
                "ranks): each holds that rank's shards, which export does not consolidate"
            )
        return _pt_source(step_dir, manifest, c.resolve(match, step, 0, 1), sub, component, match)
    raise NotImplementedError(
        f"component {match!r} of {step_dir} is in format {c.format!r}; export reads dcp, "
        "torch_dist and pt components"
    )


def read_full_state(step_dir: str | os.PathLike, component: str) -> dict[str, torch.Tensor]:
    """The sub-dict ``component`` of the committed step ``step_dir`` as full CPU tensors.

    Names are the dotted keys under ``component`` (``transformer.h.0.attn.c_attn.weight`` for
    ``component="model"`` of ``{"model": model.state_dict()}``), in the checkpoint's order.
    Needs no process group: a DCP checkpoint (``dcp``, a ``dcp`` component, Megatron
    ``torch_dist``, whose shards are DCP underneath) is read with ``no_dist=True``, each tensor
    assembled whole from the chunks every rank wrote, and only the keys under ``component`` are
    read (not the optimizer's). A ``pt`` component is read with ``torch.load(weights_only=True)``.

    Before anything is read, the manifest's checksums of the files it is read from are verified
    (``CorruptCheckpoint``; a step without a manifest is refused). Non-tensor leaves (ints,
    strings, pickled objects) are skipped: safetensors holds tensors only. ``UnknownComponent``
    (a ``KeyError``) lists the keys there are when ``component`` is not in the step;
    ``ValueError`` when it names a group of components, a single value or no tensors. A Megatron
    legacy component and per-rank pt files of several ranks are not supported
    (``NotImplementedError``).
    """
    source = _open_source(step_dir, component)
    if source.skipped:
        log.debug("export of %r: skipped non-tensor leaves %s", component, source.skipped)
    return source.read(list(source.entries))
