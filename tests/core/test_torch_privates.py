"""torch's private parts are used in one module (``asyncckpt/_torch.py``), beside the record
reader's own guarded fast path; where a torch release lacks one, the public way is taken,
counted and logged once, and the checkpoint is the same."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch
from statecmp import assert_same

import asyncckpt
from asyncckpt import SyncCheckpointEngine, _torch

PACKAGE = Path(asyncckpt.__file__).parent
#: Modules allowed to touch torch's private names: the fence, and LocalShard's wrapper
#: subclass (``torch.Tensor._make_wrapper_subclass``, how torch documents subclasses).
FENCED = {"_torch.py", "dist.py"}
#: Private attributes of tensors the package reads (through ``_torch`` alone).
TENSOR_PRIVATES = {"_version", "_checkpoint_offset"}


def private_uses(path: Path) -> list[str]:
    """``torch``-rooted names with a part that starts with one underscore, used in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names = [node.module, *(a.name for a in node.names)]
            out += [n for n in names if any(p.startswith("_") for p in n.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr in TENSOR_PRIVATES:
            out.append(f"<tensor>.{node.attr}")
        elif isinstance(node, ast.Attribute):
            chain, cur = [node.attr], node.value
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch":
                dotted = ".".join(["torch", *reversed(chain)])
                if any(p.startswith("_") and not p.startswith("__") for p in chain):
                    out.append(dotted)
    return out


def test_torch_privates_live_behind_one_module():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        uses = private_uses(path)
        if uses and rel not in FENCED:
            found[rel] = uses
    assert found == {}
    assert private_uses(PACKAGE / "_torch.py")  # the scan sees what it should


@pytest.fixture
def fresh_fallbacks(monkeypatch):
    monkeypatch.setattr(_torch, "fallbacks", type(_torch.fallbacks)())
    monkeypatch.setattr(_torch, "_logged", set())
    return _torch


def test_foreach_copy_falls_back_visibly(fresh_fallbacks, monkeypatch, caplog):
    monkeypatch.delattr(torch, "_foreach_copy_")
    dst, src = [torch.zeros(3), torch.zeros(2)], [torch.ones(3), torch.full((2,), 2.0)]
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        _torch.foreach_copy_(dst, src)
        _torch.foreach_copy_(dst, src)
    assert_same(dst, src)
    assert _torch.fallbacks["torch._foreach_copy_"] == 2
    assert sum("_foreach_copy_" in r.getMessage() for r in caplog.records) == 1


def test_a_torch_without_dcps_private_shortcuts_writes_the_same_checkpoint(
    tmp_path, fresh_fallbacks, monkeypatch
):
    """The trainer's copies fall back in this process (the worker's DCP writer is another
    process: its shortcuts are covered by the unit tests)."""
    state = {"w": torch.randn(4, 3), "n": 7, "layers": [torch.arange(5), torch.ones(2)]}
    with SyncCheckpointEngine(tmp_path / "fast", keep=None) as engine:
        engine.save(1, state).committed_sync()
    monkeypatch.delattr(torch, "_foreach_copy_")
    with SyncCheckpointEngine(tmp_path / "slow", keep=None) as engine:
        engine.save(1, state).committed_sync()
        target = {
            "w": torch.zeros(4, 3),
            "n": 0,
            "layers": [torch.zeros(5, dtype=torch.int64), torch.zeros(2)],
        }
        assert engine.load_latest(target) == 1
    assert_same(target, state)
    assert _torch.fallbacks["torch._foreach_copy_"] >= 1
    fast = asyncckpt.read_checkpoint(tmp_path / "fast" / "global_step_1")
    assert_same(asyncckpt.read_checkpoint(tmp_path / "slow" / "global_step_1"), fast)


def test_the_inner_loader_falls_back_visibly(fresh_fallbacks, monkeypatch):
    from torch.distributed.checkpoint import state_dict_loader

    assert _torch.inner_dcp_load() is state_dict_loader._load_state_dict
    monkeypatch.delattr(state_dict_loader, "_load_state_dict")
    assert _torch.inner_dcp_load() is None  # then the loader calls dcp.load itself
    assert _torch.fallbacks["state_dict_loader._load_state_dict"] == 1


def test_the_stateful_shortcut_falls_back_visibly(fresh_fallbacks, monkeypatch):
    """A torch without ``_stateful_to_state_dict``: nothing is replaced (this torch's own
    ``dcp.save`` calls it, so only the fence itself can be run without it here)."""
    from torch.distributed.checkpoint import state_dict_saver

    monkeypatch.delattr(state_dict_saver, "_stateful_to_state_dict")
    with _torch.stateful_entries_as_is():
        assert not hasattr(state_dict_saver, "_stateful_to_state_dict")
    assert not hasattr(state_dict_saver, "_stateful_to_state_dict")
    assert _torch.fallbacks["state_dict_saver._stateful_to_state_dict"] == 1


def test_dcp_file_split_matches_torchs(tmp_path):
    """Our public re-implementation of DCP's split of items into files (several threads)
    gives the same files DCP's own writer would: the checkpoint reads back with plain DCP."""
    import torch.distributed.checkpoint as dcp

    from asyncckpt.formats.dcp import write_flat

    flat = {f"t{i}": torch.randn(i + 1, 7) for i in range(9)}
    write_flat(flat, tmp_path / "c", thread_count=3)
    files = sorted(p.name for p in (tmp_path / "c").glob("*.distcp"))
    assert len(files) == 3
    target = {k: torch.zeros_like(v) for k, v in flat.items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert_same(target, flat)


def multiprocessing_privates(path: Path) -> list[str]:
    """Private attributes read off ``multiprocessing`` or its process objects in ``path``
    (e.g. ``multiprocessing.current_process()._config``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
            continue
        if node.attr.startswith("__"):
            continue
        base = node.value
        while isinstance(base, (ast.Attribute, ast.Call)):
            base = base.func if isinstance(base, ast.Call) else base.value
        if isinstance(base, ast.Name) and base.id in ("multiprocessing", "mp", "tmp"):
            out.append(f"{base.id}...{node.attr}")
    return out


def test_no_private_multiprocessing_flags():
    """A worker's stand-in is a plain child process (stand_in.py), not a multiprocessing child
    made possible by clearing the worker's private daemon flag."""
    found = {
        path.relative_to(PACKAGE).as_posix(): uses
        for path in PACKAGE.rglob("*.py")
        if (uses := multiprocessing_privates(path))
    }
    assert found == {}


def test_the_multiprocessing_scan_sees_a_private_flag(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import multiprocessing\nmultiprocessing.current_process()._config['daemon'] = False\n"
    )
    assert multiprocessing_privates(bad) == ["multiprocessing..._config"]
