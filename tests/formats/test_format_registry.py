"""Formats are ``Format`` objects in a registry (issue 12): the built-in ones are looked up by
name and alias, and a user's own format, registered without touching the engine, is staged,
written, checked and loaded through the same seams as the built-in ones.

The toy format here keeps every tensor and object of a state in one ``torch.save`` file.
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from statecmp import assert_same

from asyncckpt import Preemption, StateMismatch, SyncCheckpointEngine
from asyncckpt.core import layout as L
from asyncckpt.core.tree import flatten_state, merge_into, unflatten
from asyncckpt.formats import (
    FORMAT_ALIASES,
    FORMATS,
    check_format,
    components,
    default_format,
    format_names,
    get_format,
    loadcheck,
    register_format,
    staged,
    unregister_format,
)
from asyncckpt.formats.base import (
    Crcs,
    Format,
    LoadOptions,
    Paths,
    Prepared,
    SaveOptions,
    WriteOptions,
)
from asyncckpt.staging.arenas import serialize_objects
from asyncckpt.storage.manifest import checksum


class OneFile(Format):
    """Every tensor and object of the state in one ``torch.save`` file, written by rank 0."""

    name = "onefile"
    FILE = "state.pt"

    def prepare(self, state: Any, options: SaveOptions) -> Prepared:
        flat = flatten_state(state)  # DCP keys; tensors to stage, the rest pickled now
        return Prepared(flat.tensors, serialize_objects(flat.objects), flat.paths)

    def write(self, part: Prepared, location: Path, options: WriteOptions) -> Crcs:
        if options.rank != 0:
            return {}
        buf = io.BytesIO()
        objects = {k: bytes(v) for k, v in part.objects.items()}  # plain bytes: weights_only
        torch.save({"tensors": dict(part.tensors), "objects": objects}, buf)
        (location / self.FILE).write_bytes(buf.getvalue())
        return {self.FILE: (checksum(buf.getvalue()), len(buf.getvalue()))}

    def _flat(self, location: Path) -> dict[str, Any]:
        saved = torch.load(location / self.FILE, weights_only=True)
        objects = {
            k: torch.load(io.BytesIO(b), weights_only=False) for k, b in saved["objects"].items()
        }
        return {**saved["tensors"], **objects}

    def read(self, location: Path, paths: Paths) -> dict[str, Any]:
        return unflatten(self._flat(location), paths or {})

    def load_into(self, state: Any, location: Path, paths: Paths, options: LoadOptions) -> None:
        merge_into(state, self.read(location, paths))

    def entries(self, state: Any, location: Path, options: LoadOptions) -> loadcheck.Entries:
        def entry(v: Any) -> Any:  # (shape, dtype) of a tensor, None for another value
            return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None

        return loadcheck.Entries({k: entry(v) for k, v in self._flat(location).items()})

    def read_by_check(self, path: Path, location: Path) -> bool:
        return path == location / self.FILE


@pytest.fixture
def onefile() -> Iterator[OneFile]:
    fmt = OneFile()
    register_format(fmt, aliases=("one",))
    try:
        yield fmt
    finally:
        unregister_format("onefile")


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.arange(3) + step},
        "optim": {"state": {0: {"m": torch.randn(2, generator=g)}}, "lr": 0.1 * step},
        "layers": [torch.ones(2) * step, {"name": f"run-{step}"}],
        "step": step,
    }


def blank() -> dict:
    return {
        "model": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.int64)},
        "optim": {"state": {}, "lr": 0.0},
        "layers": [torch.zeros(2), {}],
        "step": 0,
    }


# ------------------------------------------------------------------------------ the registry


def test_the_built_in_formats_by_name_and_alias() -> None:
    assert format_names() == ("dcp", "torch_dist", "megatron_legacy", "pt")
    assert FORMATS == ("dcp", "torch_dist", "megatron_legacy")
    assert [get_format(n).name for n in format_names()] == list(format_names())
    assert get_format("torch") is get_format("legacy") is get_format("megatron_legacy")
    assert FORMAT_ALIASES == {"torch": "megatron_legacy", "legacy": "megatron_legacy"}
    assert check_format("torch") == "megatron_legacy"
    assert (default_format("megatron"), default_format("global_step")) == ("torch_dist", "dcp")
    # pt is one file: a component's format, not a checkpoint's.
    assert check_format("pt", component=True) == "pt"
    with pytest.raises(ValueError, match=r"unknown format 'pt'; expected one of \('dcp', "):
        check_format("pt")


def test_an_unknown_format_names_the_registered_ones() -> None:
    with pytest.raises(ValueError) as info:
        get_format("safetensors")
    assert str(info.value) == (
        "unknown format 'safetensors'; expected one of "
        "('dcp', 'torch_dist', 'megatron_legacy', 'pt')"
    )
    with pytest.raises(ValueError, match="unknown format 'safetensors'"):
        check_format("safetensors", component=True)


def test_register_refuses_a_taken_name_or_alias(onefile: OneFile) -> None:
    class Again(OneFile):
        pass

    for name, aliases in [("onefile", ()), ("dcp", ()), ("torch", ()), ("x", ("one",))]:
        again = Again()
        again.name = name
        with pytest.raises(ValueError, match="already taken"):
            register_format(again, aliases=aliases)
    with pytest.raises(TypeError, match="Format instance"):
        register_format("onefile")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="built in"):
        unregister_format("dcp")
    assert format_names()[-1] == "onefile" and "x" not in FORMAT_ALIASES


def test_a_registered_format_is_found_like_a_built_in_one(onefile: OneFile) -> None:
    assert get_format("onefile") is get_format("one") is onefile
    assert check_format("one") == "onefile"  # owns a directory: a checkpoint's format
    assert format_names() == ("dcp", "torch_dist", "megatron_legacy", "pt", "onefile")
    assert components.Component("one").format == "onefile"
    unregister_format("onefile")
    assert "one" not in FORMAT_ALIASES
    with pytest.raises(ValueError, match="unknown component format 'onefile'"):
        components.Component("onefile")
    register_format(onefile, aliases=("one",))  # for the fixture to take back


# ------------------------------------------------------------------------------ the seams


def test_staged_write_and_load_into_round_trip(tmp_path: Path, onefile: OneFile) -> None:
    """The trainer's prepare, the worker's write, the pre-load check and the load, by name."""
    state = state_at(3)
    prepared = staged.prepare("one", state)
    assert set(prepared.tensors) == {"model.w", "model.b", "optim.state.0.m", "layers.0"}
    staged.write("onefile", prepared.tensors, prepared.objects, prepared.extra, tmp_path)
    assert os.listdir(tmp_path) == ["state.pt"]

    target = blank()
    w = target["model"]["w"]
    report = loadcheck.check("onefile", target, tmp_path)
    assert report.exact
    assert loadcheck.read_by_check("state.pt", [_part(target, tmp_path)], tmp_path)
    staged.load_into("onefile", target, tmp_path, prepared.paths)
    assert target["model"]["w"] is w  # in place
    assert_same(target, state)
    assert_same(get_format("onefile").read(tmp_path, prepared.paths), state)  # no target

    wrong = blank()
    wrong["model"]["w"] = torch.zeros(3, 4)
    with pytest.raises(
        StateMismatch, match=r"model\.w: target \(3, 4\) float32, checkpoint \(4, 3\)"
    ):
        loadcheck.check("onefile", wrong, tmp_path)


def _part(state: Any, location: Path) -> components.Part:
    return components.Part(None, "onefile", state, location, None)


def test_the_format_travels_to_a_worker_that_never_registered_it(
    tmp_path: Path, onefile: OneFile
) -> None:
    """The worker is a spawned process: what it gets is the pickled job, format included."""
    prepared = staged.prepare("onefile", state_at(1))
    extra = pickle.loads(pickle.dumps(prepared.extra))
    unregister_format("onefile")
    try:
        staged.write("onefile", prepared.tensors, prepared.objects, extra, tmp_path)
    finally:
        register_format(onefile, aliases=("one",))
    target = blank()
    staged.load_into("onefile", target, tmp_path, prepared.paths)
    assert_same(target, state_at(1))


def test_a_component_in_a_registered_format(tmp_path: Path, onefile: OneFile) -> None:
    """Components dispatch each part through the registry, a user's format included."""
    spec = components.check_spec(
        {"model": "onefile", "data": components.Component("pt", path="d/data.pt")}
    )
    state = {"model": state_at(2), "data": {"epoch": 2, "seen": torch.arange(4)}}
    prepared = components.prepare(spec, state, rank=0)
    crcs = staged.write(
        components.COMPONENTS, prepared.tensors, prepared.objects, prepared.extra, tmp_path
    )
    assert sorted(crcs) == ["d/data.pt", "model/state.pt"]
    for rel, (crc, size) in crcs.items():
        assert (crc, size) == (
            checksum((tmp_path / rel).read_bytes()),
            (tmp_path / rel).stat().st_size,
        )
    target = {"model": blank(), "data": {"epoch": 0, "seen": torch.zeros(4, dtype=torch.int64)}}
    manifest = {"paths": prepared.paths, "step": 0, **prepared.extra["manifest"]}
    for part in components.load_parts(spec, manifest, target, tmp_path, 0):
        loadcheck.check(part.fmt, part.state, part.location)
        staged.load_into(part.fmt, part.state, part.location, part.paths)
    assert_same(target, state)


# ------------------------------------------------------------------------------ the engine


def engine_accepts_registered_formats() -> bool:
    """The engine checks ``format=`` with ``formats.check_format`` (the registry)."""
    from asyncckpt.trainer import parts as engine

    return "check_format" in inspect.getsource(engine)


@pytest.mark.skipif(
    not engine_accepts_registered_formats(),
    reason="the engine still checks format= against its own list (formats.FORMATS)",
)
def test_engine_saves_and_loads_a_registered_format(tmp_path: Path, onefile: OneFile) -> None:
    from asyncckpt.formats.reading import read_checkpoint

    with SyncCheckpointEngine(
        tmp_path, format="one", preemption=Preemption(handle_sigterm=False)
    ) as engine:
        engine.save(5, state_at(5)).committed_sync(timeout=120)
    step_dir = tmp_path / L.dir_name("global_step", 5)
    assert sorted(os.listdir(step_dir)) == sorted(["state.pt", L.MANIFEST])
    target = blank()
    engine = SyncCheckpointEngine(
        tmp_path, format="onefile", preemption=Preemption(handle_sigterm=False)
    )
    assert engine.load_latest(target) == 5
    assert_same(target, state_at(5))
    assert_same(read_checkpoint(step_dir), state_at(5))
