"""The flattening plan: replayed only while the state keeps its structure, and then exactly
what a fresh ``flatten_state`` gives."""

from __future__ import annotations

import copy

import pytest
import torch
from statecmp import assert_same

from asyncckpt import SyncCheckpointEngine
from asyncckpt.core.tree import flatten_state
from asyncckpt.staging.flatplan import FlattenCache, FlattenPlan
from asyncckpt.testing import parts


def make_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    return {
        "model": model,
        "optim": optim,
        "layers": [{"w": torch.randn(2, 2)}, {"w": torch.randn(2, 2)}],
        "by_id": {0: torch.zeros(3), 7: torch.ones(3, dtype=torch.int64)},
        "empty": {},
        "lrs": [0.1, 0.2],
        "step": seed,
        "name": "run",
    }


def same_flat(a, b) -> None:
    assert list(a.tensors) == list(b.tensors) and list(a.objects) == list(b.objects)
    assert a.paths == b.paths
    for k in a.tensors:
        assert a.tensors[k] is b.tensors[k] or torch.equal(a.tensors[k], b.tensors[k]), k
    assert_same(a.objects, b.objects)


def test_replay_is_what_a_fresh_flatten_gives():
    state = make_state()
    flat, plan = FlattenPlan.record(state)
    assert plan is not None
    same_flat(flat, flatten_state(state))
    state["step"] = 5  # values change, structure does not
    state["layers"][1]["w"] = torch.full((2, 2), 3.0)  # a new tensor object of the same shape
    replayed = plan.replay(state)
    assert replayed is not None
    same_flat(replayed, flatten_state(state))
    assert replayed.tensors["layers.1.w"] is state["layers"][1]["w"]
    assert replayed.key == tuple((k, t.dtype, tuple(t.shape)) for k, t in replayed.tensors.items())


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update(extra=torch.ones(1)),  # a key added
        lambda s: s.pop("name"),  # a key removed
        lambda s: s.update(name2=s.pop("name")),  # renamed: same length
        lambda s: s["by_id"].update({8: s["by_id"].pop(7)}),  # an int key renamed
        lambda s: s["layers"].append({"w": torch.zeros(2, 2)}),  # a list grows
        lambda s: s["layers"][0].update(w=torch.zeros(3, 2)),  # a shape
        lambda s: s["layers"][0].update(w=torch.zeros(2, 2, dtype=torch.float64)),  # a dtype
        lambda s: s.update(step=torch.tensor(1)),  # an object becomes a tensor
        lambda s: s["by_id"].update({0: "gone"}),  # a tensor becomes an object
        lambda s: s.update(lrs=[torch.ones(1)]),  # a leaf list now holds a tensor
        lambda s: s.update(empty={"now": 1}),  # an empty dict leaf is no longer empty
        lambda s: s.update(model=torch.nn.Linear(3, 3)),  # a module of another shape
        lambda s: s.update(layers=dict(enumerate(s["layers"]))),  # a list -> an int-keyed dict
        lambda s: s.update(by_id=[s["by_id"][0], s["by_id"][7]]),  # a dict -> a list, same length
        lambda s: s.update(layers=[torch.zeros(2, 2), s["layers"][1]]),  # a container -> a tensor
    ],
)
def test_any_change_of_structure_is_flattened_afresh(change):
    state = make_state()
    cache = FlattenCache()
    cache.flatten(state)
    change(state)
    assert cache.plan.replay(state) is None
    same_flat(cache.flatten(state), flatten_state(state))
    assert cache.hits == 0
    cache.flatten(state)  # the new structure's plan
    assert cache.hits == 1


def test_the_plan_does_not_keep_the_first_save_alive():
    import gc
    import weakref

    state = {"w": torch.ones(1000)}
    cache = FlattenCache()
    cache.flatten(state)
    ref = weakref.ref(state["w"])
    state["w"] = torch.zeros(1000)
    gc.collect()
    assert ref() is None


def test_an_engine_saves_a_state_whose_structure_changes(tmp_path):
    state = make_state(1)
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state)
        engine.save(2, state)  # replayed
        changed = copy.deepcopy(state)
        changed["layers"].append({"w": torch.full((2, 2), 9.0)})
        changed["step"] = 3
        engine.save(3, changed)
        engine.wait()
        assert parts(engine).saver.flatten_cache.hits >= 1
        target = make_state(0)
        target["layers"].append({"w": torch.zeros(2, 2)})
        assert engine.load_latest(target) == 3
    assert_same(target["layers"], changed["layers"])
    assert target["step"] == 3
    assert_same(target["model"].state_dict(), changed["model"].state_dict())


def test_paths_travel_once_per_plan_and_again_to_a_new_worker(tmp_path):
    """A replayed plan's saves send no paths (the worker keeps the last ones); every manifest
    still records them, also the first save after the worker was killed and replaced."""
    import json
    import os
    import signal
    import time

    from asyncckpt.core import layout as L

    state = make_state(2)
    with SyncCheckpointEngine(tmp_path) as engine:
        core = parts(engine)
        state["step"] = 1
        engine.save(1, state)
        engine.wait()
        link = core.supervisor.link
        first = link.paths
        state["step"] = 2
        engine.save(2, state)
        engine.wait()
        assert link.paths is first and core.saver.flatten_cache.hits >= 1
        pid = engine.worker_pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while core.supervisor.link is link and time.monotonic() < deadline:
            time.sleep(0.05)  # the engine notices the death and starts a new worker
        assert core.supervisor.link.paths is None  # the new worker has been sent nothing yet
        state["step"] = 3
        engine.save(3, state)
        engine.wait()
        assert engine.worker_pid != pid
    manifests = [
        json.loads((tmp_path / f"global_step_{s}" / L.MANIFEST).read_text()) for s in (1, 2, 3)
    ]
    assert manifests[0]["paths"] and all(m["paths"] == manifests[0]["paths"] for m in manifests)
    for step in (1, 2, 3):
        target = make_state(0)
        with SyncCheckpointEngine(tmp_path) as engine:
            assert engine.load(target, step=step) == step
        assert target["step"] == step and target["by_id"][7].dtype == torch.int64


def test_a_save_that_waits_for_a_replaced_worker_sends_it_the_paths(tmp_path):
    """The worker dies on a job that carried no paths (a replayed plan); the next save, made
    at once, waits for its slot and the new worker: it must carry the paths (before the fix
    it was sent without them and its manifest recorded none: a wrong structure at load)."""
    import json

    from asyncckpt import WorkerDied, faults
    from asyncckpt.core import layout as L

    state = make_state(4)
    with SyncCheckpointEngine(tmp_path) as engine:
        state["step"] = 1
        engine.save(1, state).committed_sync(120)
        faults.inject("before_shard_write", "kill")
        state["step"] = 2
        doomed = engine.save(2, state)
        state["step"] = 3
        survivor = engine.save(3, state)  # waits for the slot, then for the new worker
        with pytest.raises(WorkerDied):
            doomed.committed_sync(120)
        survivor.committed_sync(120)
    manifest = json.loads((tmp_path / "global_step_3" / L.MANIFEST).read_text())
    first = json.loads((tmp_path / "global_step_1" / L.MANIFEST).read_text())
    assert manifest["paths"] == first["paths"] and manifest["paths"]
    target = make_state(0)
    assert SyncCheckpointEngine(tmp_path).load_latest(target) == 3
    assert target["step"] == 3
    assert_same(target["layers"], state["layers"])


def test_prepare_sends_the_paths_ahead_so_the_first_save_carries_none(tmp_path, monkeypatch):
    """``prepare`` hands the worker the paths with the arenas (for 100,000 tensors, pickling
    them into the first save's job was ~0.5 s of its stall); the manifest still has them."""
    import json

    from asyncckpt.core import layout as L
    from asyncckpt.trainer import saving

    sent = []
    encode = saving._encode_job
    monkeypatch.setattr(saving, "_encode_job", lambda job: sent.append(job.paths) or encode(job))
    state = make_state(3)
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.prepare(state)
        assert parts(engine).supervisor.link.paths is not None
        for step in (1, 2):
            state["step"] = step
            engine.save(step, state).committed_sync(120)
    assert sent == [None, None]
    manifest = json.loads((tmp_path / "global_step_1" / L.MANIFEST).read_text())
    assert manifest["paths"]
    target = make_state(0)
    assert SyncCheckpointEngine(tmp_path).load_latest(target) == 2
    assert target["step"] == 2
    assert_same(target["layers"], state["layers"])


def test_a_replay_does_not_run_the_garbage_collector():
    """A replay allocates no per-tensor container objects that live together: 20,000 fresh
    torch.Size objects in one list ran 85 collections per replay (7 of the older generation),
    which pushed them into the oldest one and triggered a full collection (0.15 s) inside a
    save every few saves."""
    import gc

    from asyncckpt.staging.flatplan import FlattenCache

    state = {f"g{i}": {f"t{j}": torch.zeros(4) for j in range(100)} for i in range(200)}
    cache = FlattenCache()
    cache.flatten(state)  # records
    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        flat = cache.flatten(state)
    finally:
        gc.callbacks.remove(count)
    assert cache.hits == 1 and len(flat.tensors) == 20_000
    assert len(runs) <= 2 and max(runs, default=0) == 0, runs


def test_the_recorded_and_every_replayed_flattening_hand_out_one_key_object():
    # The first save's slot keeps the recorded flattening's key; a replay's key equal but not
    # the same object made every later save compare the two entry by entry (~1 ms a compare
    # at 20,000 tensors, twice per save).
    state = make_state()
    cache = FlattenCache()
    first = cache.flatten(state)
    assert first.key == tuple((k, t.dtype, tuple(t.shape)) for k, t in first.tensors.items())
    again = cache.flatten(state)
    assert cache.hits == 1 and again.key is first.key


def test_replay_takes_whole_containers_by_values_and_reordered_keys_one_by_one():
    g = torch.Generator().manual_seed(0)
    experts = {f"e{i}": {f"w{j}": torch.randn(2, generator=g) for j in range(3)} for i in range(3)}
    state = {"experts": experts, "layers": [torch.randn(2, generator=g) for _ in range(3)]}
    state["mixed"] = {"a": torch.zeros(1), "sub": {"b": torch.ones(1)}, "n": 3}
    state["model"] = torch.nn.Linear(2, 2)  # an OrderedDict state_dict
    flat, plan = FlattenPlan.record(state)
    assert plan is not None
    whole = [w for _, w, _ in plan.groups]
    assert whole.count(True) == 3 + 1 + 1 + 1 and not all(whole)  # experts, layers, sub, model
    again = plan.replay(state)
    assert again is not None and list(again.tensors) == list(flat.tensors)
    # The same tensors (a module's state_dict() makes new detached objects of its parameters).
    same = zip(again.tensors.values(), flat.tensors.values(), strict=True)
    assert all(a is b or a.data_ptr() == b.data_ptr() for a, b in same)
    reordered = dict(reversed(list(experts["e1"].items())))  # same keys, another order
    experts["e1"] = reordered
    replayed = plan.replay(state)
    assert replayed is not None and list(replayed.tensors) == list(flat.tensors)
    for j in range(3):  # each name still gives its own tensor
        assert replayed.tensors[f"experts.e1.w{j}"] is reordered[f"w{j}"]
