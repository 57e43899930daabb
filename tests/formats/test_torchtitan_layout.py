"""The ``torchtitan`` layout (issue 14): ``{root}/step-N`` DCP directories that torchtitan's own
resume logic finds and loads, and temporaries / trash that it can never mistake for one."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from asyncckpt import CheckpointEngine, KeepLast, faults
from asyncckpt.core import layout as L


def torchtitan_find_load_step(folder: str) -> int:
    """The logic of torchtitan's ``CheckpointManager._find_load_step``
    (pytorch/torchtitan, torchtitan/components/checkpoint.py): the highest ``step-(\\d+)``
    (``re.search``, unanchored) among the folder's entries that hold a ``.metadata`` file."""
    pattern = r"step-(\d+)"
    step_counts = []
    if not os.path.isdir(folder):
        return -1
    for filename in os.listdir(folder):
        match = re.search(pattern, filename)
        metadata_probe = os.path.join(folder, filename, ".metadata")
        if match and os.path.isfile(metadata_probe):
            step_counts.append(int(match.group(1)))
    if not step_counts:
        return -1
    return max(step_counts)


class TrainState(Stateful):
    """Like torchtitan's ``TrainState``: a Stateful whose step travels as an int32 tensor."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step, dtype=torch.int32)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"].item())


def torchtitan_load(folder: str) -> tuple[int, torch.nn.Linear, TrainState]:
    """torchtitan's ``load(step=-1)``: find the step, then ``dcp.load(states, checkpoint_id=
    {folder}/step-{N})`` into Stateful / state-dict objects."""
    step = torchtitan_find_load_step(folder)
    assert step != -1, os.listdir(folder)
    model, train_state = torch.nn.Linear(4, 3), TrainState()
    states = {"model": model.state_dict(), "train_state": train_state}
    dcp.load(states, checkpoint_id=os.path.join(folder, f"step-{step}"))
    model.load_state_dict(states["model"])
    return step, model, train_state


def state_at(step: int) -> dict:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(float(step))
        model.bias.fill_(-float(step))
    return {
        "model": model.state_dict(),
        "train_state": {"step": torch.tensor(step, dtype=torch.int32)},
    }


def test_names():
    assert L.dir_name("torchtitan", 5) == "step-5"
    assert L.parse_dir_name("torchtitan", "step-5") == 5
    for foreign in ("global_step_5", "step-5x", ".tmp-step-5", "step_5", "iter_0000005"):
        assert L.parse_dir_name("torchtitan", foreign) is None
    assert L.parse_dir_name("global_step", "step-5") is None
    # Temporaries and trash hold DCP's .metadata: torchtitan's unanchored search must miss them.
    for layout in L.LAYOUTS:
        name = L.dir_name(layout, 5)
        for leftover in (L.tmp_name(layout, 5, "3-1234"), L.trash_name(name, "ab12cd34ef56")):
            assert L.is_leftover(leftover)
            assert L.TORCHTITAN_SEARCH.search(leftover) is None, leftover
            assert L.parse_dir_name(layout, leftover) is None
    # Names of the existing layouts are unchanged by that.
    assert L.tmp_name("global_step", 7, "t") == ".tmp-global_step_7-t"
    assert L.trash_name("iter_0000007", "t") == ".trash-iter_0000007-t"
    assert L.tracker_names("torchtitan") == (L.TRACKER,)


@pytest.mark.anyio
async def test_torchtitan_finds_and_loads_what_asyncckpt_wrote(tmp_path):
    root = str(tmp_path)

    def entries(prefix: str) -> list[Path]:
        # Directories only: a worker's note of who writes a temporary (``ls``) is a file
        # beside it that shares its prefix.
        named = [tmp_path / n for n in os.listdir(tmp_path) if n.startswith(prefix)]
        return [p for p in named if p.is_dir()]

    async def wait_for(prefix: str) -> Path:
        deadline = time.monotonic() + 15
        while not entries(prefix):
            assert time.monotonic() < deadline, os.listdir(tmp_path)
            time.sleep(0.01)
        return entries(prefix)[0]

    async with CheckpointEngine(tmp_path, layout="torchtitan", keep=KeepLast(2)) as engine:
        for s in (10, 20):
            await (await engine.save(s, state_at(s))).committed()
        assert sorted(os.listdir(tmp_path / "step-20")) >= [".metadata"]
        assert torchtitan_find_load_step(root) == 20

        # Mid-commit of 30 (its temporary already holds .metadata): torchtitan still finds 20.
        faults.inject("before_rename", "delay:1.5")
        faults.inject("mid_prune", "delay:1.5")
        handle = await engine.save(30, state_at(30))
        tmp = await wait_for(L.TMP_PREFIX)
        deadline = time.monotonic() + 15
        while not (tmp / ".metadata").is_file():  # the hazard is real: DCP wrote it pre-rename
            assert time.monotonic() < deadline, os.listdir(tmp)
            time.sleep(0.01)
        assert torchtitan_find_load_step(root) == 20
        step, model, train_state = torchtitan_load(root)
        assert (step, train_state.step, model.weight[0, 0].item()) == (20, 20, 20.0)

        # 30 commits; pruning step 10 goes through the trash, which still holds .metadata.
        await handle.committed()
        trash = await wait_for(L.TRASH_PREFIX)
        assert (trash / ".metadata").is_file() or not trash.exists()
        assert torchtitan_find_load_step(root) == 30
        await engine.wait()
        faults.clear()

    deadline = time.monotonic() + 15
    while entries(L.TRASH_PREFIX) or (tmp_path / "step-10").exists():
        assert time.monotonic() < deadline, os.listdir(tmp_path)
        time.sleep(0.05)
    step, model, train_state = torchtitan_load(root)
    assert (step, train_state.step) == (30, 30)
    assert torch.equal(model.weight, torch.full((3, 4), 30.0))
    assert torch.equal(model.bias, torch.full((3,), -30.0))
    # asyncckpt itself reads the same root back: tracker, layout detection, its own load.
    from asyncckpt.storage.manifest import verify
    from asyncckpt.storage.prune import detect_layout

    assert L.read_tracker(root) == 30 and detect_layout(root) == "torchtitan"
    assert [c.step for c in L.scan(root, "torchtitan")] == [20, 30]
    assert verify(root).ok
    probe = state_at(0)
    assert await CheckpointEngine(tmp_path, layout="torchtitan").load_latest(probe) == 30
    assert probe["train_state"]["step"].item() == 30
