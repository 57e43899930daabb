"""torch's own DCP tools read an asyncckpt checkpoint as they read a plain ``dcp.save`` (issue
32.5): ``.metadata``'s ``planner_data`` maps every key to its object path in the nested state,
so ``dcp_to_torch_save`` (and its command line) gives back the nested state, not flat keys.
And DCP's ``CheckpointException`` (a BaseException) reaches callers as a ``CheckpointError``."""

from __future__ import annotations

import errno
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from statecmp import assert_same
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from asyncckpt import CheckpointError, SyncCheckpointEngine, read_checkpoint
from asyncckpt.formats import dcp as dcp_format
from asyncckpt.worker.export import read_full_state


@pytest.fixture(autouse=True)
def _quiet_dcp():
    # DCP warns on every single-process save/load that torch.distributed is not initialised.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def training_state() -> dict:
    """A model and its optimizer after a step (int-keyed state, lists and tuples in
    param_groups, ints, floats, bools, None), plus plain values and a list of tensors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "epoch": 3,
        "loss": 0.25,
        "history": [1, 2.5, "x"],
        "buffers": [torch.arange(3), {"ema": torch.ones(2, dtype=torch.bfloat16)}],
        "config": {"name": "run", "sizes": [4, 3, 2]},
    }


def plain_dcp(state: dict, path) -> None:
    dcp.save(state, checkpoint_id=path)


def converted(src, dst) -> dict:
    dcp_to_torch_save(src, dst)
    return torch.load(dst, weights_only=False)


def test_dcp_to_torch_save_gives_the_nested_state_of_a_plain_dcp_save(tmp_path):
    state = training_state()
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        eng.save(1, state).committed_sync(60)
    ours = tmp_path / "r" / "global_step_1"
    plain_dcp(state, tmp_path / "plain")
    want = converted(tmp_path / "plain", tmp_path / "plain.pt")
    got = converted(ours, tmp_path / "ours.pt")
    assert "optim" in got and "optim.param_groups.0.lr" not in got
    assert got["optim"]["param_groups"][0]["lr"] == 1e-3
    assert_same(got, want)
    # The mapping itself is DCP's, key for key.
    assert (
        FileSystemReader(ours).read_metadata().planner_data
        == FileSystemReader(tmp_path / "plain").read_metadata().planner_data
    )


def test_dcp_to_torch_command_line_gives_the_nested_state(tmp_path):
    state = training_state()
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        eng.save(1, state).committed_sync(60)
    plain_dcp(state, tmp_path / "plain")
    for src, dst in ((tmp_path / "r" / "global_step_1", "ours.pt"), (tmp_path / "plain", "p.pt")):
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch"]
            + [str(src), str(tmp_path / dst)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    got = torch.load(tmp_path / "ours.pt", weights_only=False)
    assert_same(got, torch.load(tmp_path / "p.pt", weights_only=False))
    assert sorted(got) == sorted(state)


def test_a_default_planner_dcp_load_of_the_nested_state(tmp_path):
    state = training_state()
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        eng.save(1, state).committed_sync(60)
    target = training_state()
    for t in (*target["model"].values(), *target["optim"]["state"][0].values()):
        t.zero_()
    target["epoch"] = 0
    dcp.load(target, checkpoint_id=tmp_path / "r" / "global_step_1")  # DefaultLoadPlanner
    assert_same(target, state)


def test_a_dcp_component_records_its_own_object_paths(tmp_path):
    state = {"policy": training_state(), "data": {"seen": 7}}
    with SyncCheckpointEngine(tmp_path / "r", components={"policy": "dcp", "data": "pt"}) as eng:
        eng.save(1, state).committed_sync(60)
    policy = tmp_path / "r" / "global_step_1" / "policy"
    plain_dcp(state["policy"], tmp_path / "plain")
    assert_same(
        converted(policy, tmp_path / "ours.pt"), converted(tmp_path / "plain", tmp_path / "p.pt")
    )


def test_the_cached_plan_follows_a_changed_object_path(tmp_path):
    """Two states with the same keys, dtypes and shapes but other paths ({"a": {"0": t}} and
    {"a": [t]}, both key "a.0"): the worker's cached DCP plan (and the planner_data in it)
    must not be reused for the second."""
    t = torch.arange(4.0)
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        eng.save(1, {"a": {"0": t}}).committed_sync(60)
        eng.save(2, {"a": [t]}).committed_sync(60)
        eng.save(3, {"a": {"0": t}}).committed_sync(60)
    for step, want in ((1, {"a": {"0": t}}), (2, {"a": [t]}), (3, {"a": {"0": t}})):
        got = converted(tmp_path / "r" / f"global_step_{step}", tmp_path / f"{step}.pt")
        assert_same(got, want)


def test_dcps_checkpoint_exception_reaches_readers_as_a_checkpoint_error(tmp_path, monkeypatch):
    """An I/O error while DCP reads (after the checksums passed) comes out of DCP as a
    CheckpointException, a BaseException that ``except Exception`` misses: every reader
    raises a CheckpointError with it as the cause."""
    state = training_state()
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        eng.save(1, state).committed_sync(60)
    step_dir = tmp_path / "r" / "global_step_1"

    def failing_read(self, plan, planner):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(dcp_format.CachedMetadataReader, "read_data", failing_read)
    readers = {
        "read_full_state": lambda: read_full_state(step_dir, "model"),
        "read_checkpoint": lambda: read_checkpoint(step_dir),
    }
    for name, read in readers.items():
        with pytest.raises(CheckpointError, match="Input/output error") as info:
            read()
        assert isinstance(info.value.__cause__, CheckpointException), name
