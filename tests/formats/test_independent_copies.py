"""One damaged file never takes every kept checkpoint (a root that lost every checkpoint:
tests/storage/test_quarantine.py).

With differential saves an unchanged file (frozen weights) is a hard link to the previous
checkpoint's: one inode under several steps, so one flipped bit fails every step holding it.
When retention keeps two or more steps, the link source is chosen so that a kept step shares
no file with the new one (``differential.link_source``); the rule is checked here directly
(pure, over many saves and policies) and through the engine (a flipped byte in the newest
step's frozen file: the restart loads another kept step bit for bit)."""

from __future__ import annotations

import itertools
import os
import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from statecmp import assert_same

from asyncckpt import (
    CheckpointInfo,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    RetentionPolicy,
    SyncCheckpointEngine,
)
from asyncckpt.core import layout
from asyncckpt.retention import plan_prune
from asyncckpt.storage.prune import list_quarantined

BIG = (256, 1024)  # 1 MiB of float32: a file of its own (differential.OWN_FILE_BYTES)
FROZEN = "model.frozen"


# -------------------------------------------------------------------------- the rule, pure
def simulate(
    policy: RetentionPolicy | None,
    saves: int = 24,
    loss: Callable[[int], float] = float,
    by_hand: dict[int, RetentionPolicy] | None = None,
) -> tuple[list[dict[int, frozenset[int]]], int]:
    """Saves 1..``saves`` of a state with one frozen file and one trained file, each choosing
    its link source with ``link_source`` against what ``KeepRule`` says the prune keeps, then
    pruned with ``policy`` as the worker prunes (``by_hand``: before save N, a prune with
    another policy, as the CLI's). Returns each save's kept steps -> file identities, and how
    often the frozen file was written in full."""
    from asyncckpt.formats.differential import KeepRule, link_source

    rule = KeepRule(policy)
    ids = itertools.count()
    files: dict[int, frozenset[int]] = {}  # step -> {frozen file id, trained file id}
    frozen: dict[int, int] = {}
    infos: dict[int, CheckpointInfo] = {}
    after, full = [], 0
    for step in range(1, saves + 1):
        if by_hand and step in by_hand:
            plan = plan_prune(list(infos.values()), by_hand[step], tracker_step=max(infos))
            for s in plan.delete:
                del files[s], frozen[s], infos[s]
        new = CheckpointInfo(step, float(step), {"loss": loss(step)})
        kept = rule.kept_beside(list(infos.values()), new)
        source = link_source(sorted(files, reverse=True), kept, files.get)
        if source is None:
            frozen[step] = next(ids)
            full += 1
        else:
            frozen[step] = frozen[source]
        files[step] = frozenset({frozen[step], next(ids)})
        infos[step] = new
        plan = plan_prune(list(infos.values()), policy, tracker_step=step, committed_step=step)
        assert set(plan.keep) - {step} >= kept, (step, plan.keep, kept)  # never fewer
        for s in plan.delete:
            del files[s], frozen[s], infos[s]
        after.append(dict(files))
    return after, full


def one_file_never_takes_every_kept_step(kept: dict[int, frozenset[int]]) -> bool:
    """With two or more steps kept, every file (identity) is missing from one of them."""
    if len(kept) < 2:
        return True
    every = set().union(*kept.values())
    return all(any(f not in held for held in kept.values()) for f in every)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7])
def test_keep_last_n_always_keeps_a_step_sharing_no_file_with_the_others(n):
    after, full = simulate(KeepLast(n))
    assert all(one_file_never_takes_every_kept_step(kept) for kept in after), after
    # The cost: the frozen file is written at step 1 and once more (step 2), then linked:
    # two families of steps take turns, each linking from its own.
    assert full == 2, full


def test_keep_last_1_and_keep_all_link_as_before():
    # One step kept: nothing to guard, every save links. Everything kept: step 2 writes in
    # full (it would share every file with step 1), every later save links from the newest.
    assert simulate(KeepLast(1))[1] == 1
    after, full = simulate(KeepAll())
    assert full == 2 and all(one_file_never_takes_every_kept_step(k) for k in after)
    assert simulate(None)[1] == 2


POLICIES = {
    "last2|best1": KeepLast(2) | KeepBest(1, "loss"),
    "last2|best2 max": KeepLast(2) | KeepBest(2, "loss", mode="max"),
    "last1|best1": KeepLast(1) | KeepBest(1, "loss"),
    "every4|last1": KeepEvery(4) | KeepLast(1),
    "every5 inexact|last2": KeepEvery(5, exact=False) | KeepLast(2),
    "every3": KeepEvery(3),
    "interval": KeepInterval(3.0),
}


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unions_and_milestones_keep_the_promise_whatever_the_metrics(name, seed):
    rng = random.Random(seed)
    losses = {s: rng.choice([rng.random(), rng.random() * 10, float("nan")]) for s in range(99)}
    after, full = simulate(POLICIES[name], saves=30, loss=losses.__getitem__)
    assert all(one_file_never_takes_every_kept_step(kept) for kept in after), after
    assert full < 30


def test_a_prune_by_hand_of_the_independent_copy_is_repaired_by_the_next_save():
    # A CLI prune (KeepLast(1)) leaves only the newest step before saves 7 and 12: the next
    # save cannot link from it (the two would share the frozen file) and writes it anew.
    after, full = simulate(KeepLast(2), saves=14, by_hand={7: KeepLast(1), 12: KeepLast(1)})
    assert all(one_file_never_takes_every_kept_step(kept) for kept in after), after
    assert full == 4, full


def test_the_new_steps_metrics_decide_what_is_predicted_kept():
    from asyncckpt.formats.differential import KeepRule

    rule = KeepRule(KeepLast(1) | KeepBest(1, "loss"))
    old = [CheckpointInfo(1, 1.0, {"loss": 1.0}), CheckpointInfo(2, 2.0, {"loss": 5.0})]
    # The new step is the best: only it is kept (nothing to guard); else step 1 stays too.
    assert rule.kept_beside(old, CheckpointInfo(3, 3.0, {"loss": 0.5})) == set()
    assert rule.kept_beside(old, CheckpointInfo(3, 3.0, {"loss": 9.0})) == {1}
    # A run-scoped policy keeps another run's steps: they stay kept (never fewer).
    run = KeepRule(KeepLast(1), scope="run", run_id="me")
    mine = CheckpointInfo(3, 3.0, run_id="me")
    assert run.kept_beside([CheckpointInfo(1, 1.0, run_id="other")], mine) == {1}


def test_link_source_prefers_the_first_allowed_candidate_and_skips_unknown_steps():
    from asyncckpt.formats.differential import link_source

    files = {1: frozenset({10, 11}), 2: frozenset({12, 13}), 3: frozenset({12, 14})}
    assert link_source([3, 2, 1], set(), files.get) == 3  # nothing kept beside: any
    assert link_source([3, 2, 1], {2, 3}, files.get) == 1  # 3 and 2 share 12 with each other
    assert link_source([3, 2, 1], {1, 3}, files.get) == 3  # 3 shares nothing with 1
    assert link_source([3], {3}, files.get) is None  # only itself kept: write every file
    # A step whose files could not be listed (gone meanwhile) is neither a source nor a guard.
    assert link_source([3, 2], {4}, {**files, 4: None}.get) is None


# ---------------------------------------------------------------------- through the engine
def state_of() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"frozen": torch.randn(BIG, generator=g), "policy": torch.randn(BIG, generator=g)},
        "step": 0,
    }


def snapshot(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].items()}, "step": state["step"]}


def fresh_like(state: dict) -> dict:
    return {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": -1}


def step_dir(root: Path, step: int) -> Path:
    return root / layout.dir_name("global_step", step)


def steps_on_disk(root: Path) -> list[int]:
    return [c.step for c in layout.scan(root, "global_step")]


def file_of(directory: Path, fqn: str) -> Path:
    """The shard file holding ``fqn`` (DCP's ``.metadata`` says where each item is)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(directory)).read_metadata()
    (name,) = {v.relative_path for k, v in md.storage_data.items() if k.fqn == fqn}
    return directory / name


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))


LOSSES = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 2.5, 6: 2.0}  # step 2 is the best


@pytest.mark.parametrize(
    "policy",
    [KeepLast(2), KeepLast(3), KeepLast(2) | KeepBest(1, "loss")],
    ids=["last2", "last3", "last2|best1"],
)
def test_a_flipped_byte_in_the_newest_frozen_file_leaves_a_kept_step_to_load(tmp_path, policy):
    state = state_of()
    want = {}
    with SyncCheckpointEngine(tmp_path, keep=policy) as engine:
        for step in range(1, 7):
            state["model"]["policy"].add_(1.0)  # trained; the frozen tensor never changes
            state["step"] = step
            want[step] = snapshot(state)
            engine.save(step, state, metrics={"loss": LOSSES[step]}).committed_sync()
    kept = steps_on_disk(tmp_path)
    assert len(kept) >= 2, kept
    victim = file_of(step_dir(tmp_path, kept[-1]), FROZEN)
    holders = [s for s in kept if os.path.samefile(file_of(step_dir(tmp_path, s), FROZEN), victim)]
    inodes = {s: file_of(step_dir(tmp_path, s), FROZEN).stat().st_ino for s in kept}
    # At least one kept step holds a copy of its own (another inode) of the frozen file.
    assert set(holders) != set(kept), inodes
    flip_a_byte(victim)
    expect = max(s for s in kept if s not in holders)
    target = fresh_like(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback past the damaged steps warns)
        with SyncCheckpointEngine(tmp_path, keep=policy) as engine:
            assert engine.load_latest(target) == expect
    assert_same(target, want[expect])
    assert sorted(q.step for q in list_quarantined(tmp_path, "global_step")) == holders


def pruned_after(engine: SyncCheckpointEngine, step: int) -> None:
    """Wait for the worker's prune that follows ``step``'s commit (it reports what it kept)."""
    deadline = time.monotonic() + 120
    while (done := engine.last_prune) is None or step not in done.kept:
        assert time.monotonic() < deadline, "no prune after the commit"
        time.sleep(0.02)


def test_the_steps_kept_hold_the_frozen_file_in_two_inodes_at_every_save(tmp_path):
    state = state_of()
    seen = []
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(2)) as engine:
        for step in range(1, 6):
            state["model"]["policy"].add_(1.0)
            state["step"] = step  # (the file of small items changes too: only frozen links)
            stats = engine.save(step, state).committed_sync()
            pruned_after(engine, step)
            kept = steps_on_disk(tmp_path)
            inodes = {file_of(step_dir(tmp_path, s), FROZEN).stat().st_ino for s in kept}
            seen.append((kept, len(inodes), stats.files_linked))
    assert [k for k, _, _ in seen] == [[1], [1, 2], [2, 3], [3, 4], [4, 5]]
    assert all(n == len(k) for k, n, _ in seen), seen  # never one inode under two steps
    # Step 2 writes the frozen file anew; from step 3 on it is linked (from the step the
    # prune is about to remove: the two kept steps take turns).
    assert [linked for _, _, linked in seen][1:] == [0, 1, 1, 1], seen
