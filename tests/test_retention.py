"""Retention policies, prune planning and save triggers, without a disk."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt.retention import (
    CheckpointInfo,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    KeepSteps,
    RetentionPolicy,
    SaveSchedule,
    Union,
    plan_prune,
    protected_steps,
    should_prune,
)


def ck(step: int, t: float | None = None, run_id: str | None = None, **metrics: float):
    return CheckpointInfo(step, float(step if t is None else t), metrics, 100, run_id)


# -- strategies ---------------------------------------------------------------------------------

metric_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(-5, 5).map(float)
)


@st.composite
def checkpoint_lists(draw, max_size: int = 25) -> list[CheckpointInfo]:
    steps = draw(st.lists(st.integers(0, 200), unique=True, max_size=max_size))
    out = []
    for s in steps:
        metrics = {}
        if draw(st.booleans()):
            metrics["loss"] = draw(metric_values)
        if draw(st.booleans()):
            metrics["acc"] = draw(metric_values)
        t = draw(st.floats(0, 10_000, allow_nan=False))
        run = draw(st.sampled_from([None, "a", "b"]))
        out.append(CheckpointInfo(s, t, metrics, 1, run))
    return out


simple_policies = st.one_of(
    st.integers(0, 8).map(KeepLast),
    st.builds(
        KeepBest,
        st.integers(0, 5),
        st.sampled_from(["loss", "acc", "absent"]),
        mode=st.sampled_from(["min", "max"]),
        missing=st.sampled_from(["drop", "keep"]),
    ),
    st.integers(1, 50).map(KeepEvery),
    st.floats(0.5, 5000).map(KeepInterval),
    st.lists(st.integers(0, 200), max_size=10).map(KeepSteps),
    st.just(KeepAll()),
)
policies = st.one_of(
    simple_policies,
    st.lists(simple_policies, min_size=1, max_size=4).map(lambda ps: Union(*ps)),
)


# -- policy properties --------------------------------------------------------------------------


@given(checkpoint_lists(), policies)
def test_policy_keeps_a_subset_of_input(cps, policy):
    assert policy.keep(cps) <= {c.step for c in cps}


@given(checkpoint_lists(), policies, st.randoms())
def test_policy_is_order_independent(cps, policy, rnd):
    shuffled = list(cps)
    rnd.shuffle(shuffled)
    assert policy.keep(shuffled) == policy.keep(cps)
    assert policy.explain(shuffled) == policy.explain(cps)


@given(checkpoint_lists(), policies)
def test_policy_is_stable_after_pruning(cps, policy):
    """Pruning twice with the same policy deletes nothing more the second time."""
    kept = policy.keep(cps)
    assert policy.keep([c for c in cps if c.step in kept]) == kept


@given(checkpoint_lists(), simple_policies, simple_policies)
def test_union_is_set_union(cps, a, b):
    assert (a | b).keep(cps) == a.keep(cps) | b.keep(cps)
    assert set((a | b).explain(cps)) == (a | b).keep(cps)


@given(checkpoint_lists(), st.integers(0, 30))
def test_keep_last_keeps_exactly_the_newest(cps, n):
    steps = sorted(c.step for c in cps)
    kept = KeepLast(n).keep(cps)
    assert len(kept) == min(n, len(steps))
    assert kept == set(steps[len(steps) - len(kept) :])


def _badness(value: float, mode: str) -> float:
    if math.isnan(value):
        return math.inf
    return value if mode == "min" else -value


@given(checkpoint_lists(), st.integers(0, 6), st.sampled_from(["min", "max"]))
def test_keep_best_keeps_the_best(cps, n, mode):
    scored = [c for c in cps if "loss" in c.metrics]
    kept = KeepBest(n, "loss", mode=mode).keep(cps)
    assert len(kept) == min(n, len(scored))
    assert kept <= {c.step for c in scored}
    worst_kept = max(
        (_badness(c.metrics["loss"], mode) for c in scored if c.step in kept), default=None
    )
    for c in scored:
        if c.step not in kept and worst_kept is not None:
            assert _badness(c.metrics["loss"], mode) >= worst_kept


def test_keep_best_nan_ranks_worst_and_missing_option():
    cps = [ck(1, loss=float("nan")), ck(2, loss=5.0), ck(3), ck(4, loss=1.0), ck(5, loss=-math.inf)]
    assert KeepBest(2, "loss").keep(cps) == {5, 4}
    assert KeepBest(2, "loss", mode="max").keep(cps) == {2, 4}
    assert KeepBest(4, "loss", mode="max").keep(cps) == {2, 4, 5, 1}
    assert KeepBest(1, "loss", missing="keep").keep(cps) == {5, 3}
    assert KeepBest(0, "loss", missing="keep").keep(cps) == {3}
    # ties go to the newer step
    assert KeepBest(1, "loss").keep([ck(1, loss=0.5), ck(9, loss=0.5)]) == {9}


def test_keep_every_interval_steps_all():
    cps = [ck(s, t=t) for s, t in [(10, 5), (20, 95), (30, 105), (40, 150), (50, 260)]]
    assert KeepEvery(20).keep(cps) == {20, 40}
    assert KeepInterval(100).keep(cps) == {10, 30, 50}
    assert KeepSteps([20, 999]).keep(cps) == {20}
    assert KeepAll().keep(cps) == {10, 20, 30, 40, 50}
    assert KeepLast(0).keep(cps) == set()


@pytest.mark.parametrize(
    "make, exc",
    [
        (lambda: KeepLast(-1), ValueError),
        (lambda: KeepLast(1.5), TypeError),
        (lambda: KeepLast(True), TypeError),
        (lambda: KeepBest(1, ""), TypeError),
        (lambda: KeepBest(1, "loss", mode="lowest"), ValueError),
        (lambda: KeepBest(1, "loss", missing="nope"), ValueError),
        (lambda: KeepEvery(0), ValueError),
        (lambda: KeepInterval(0), ValueError),
        (lambda: KeepInterval(float("inf")), ValueError),
        (lambda: KeepInterval("1h"), TypeError),
        (lambda: KeepSteps("12"), TypeError),
        (lambda: KeepSteps([1, -2]), ValueError),
        (lambda: Union(KeepLast(1), 3), TypeError),
        (lambda: KeepLast(1) | 3, TypeError),
    ],
)
def test_bad_arguments_are_rejected(make, exc):
    with pytest.raises(exc):
        make()


def test_reprs_and_equality():
    p = KeepLast(3) | KeepBest(1, "loss") | (KeepEvery(1000) | KeepInterval(3600))
    assert repr(p) == "KeepLast(3) | KeepBest(1, 'loss') | KeepEvery(1000) | KeepInterval(3600)"
    assert repr(KeepBest(2, "acc", mode="max", missing="keep")) == (
        "KeepBest(2, 'acc', mode='max', missing='keep')"
    )
    assert repr(KeepSteps({30, 10})) == "KeepSteps([10, 30])"
    assert repr(KeepAll()) == "KeepAll()"
    assert KeepLast(3) == KeepLast(3) and hash(KeepLast(3)) == hash(KeepLast(3))
    assert isinstance(p, RetentionPolicy) and len(p.policies) == 4


# -- plan_prune ---------------------------------------------------------------------------------

step_choice = st.one_of(st.none(), st.integers(0, 200))


@settings(max_examples=300)
@given(
    checkpoint_lists(),
    st.one_of(st.none(), policies),
    step_choice,
    step_choice,
    st.lists(st.integers(0, 200), max_size=3),
    st.lists(st.integers(0, 200), max_size=3),
    st.randoms(),
)
def test_plan_prune_never_deletes_protected(cps, policy, tracker, resumed, pinned, in_use, rnd):
    kw = dict(tracker_step=tracker, resumed_from=resumed, pinned=pinned, in_use=in_use)
    plan = plan_prune(cps, policy, **kw)
    steps = {c.step for c in cps}
    assert set(plan.keep).isdisjoint(plan.delete)
    assert set(plan.keep) | set(plan.delete) == steps
    assert plan.delete == sorted(plan.delete)
    must_keep = ({max(steps)} if steps else set()) | {tracker, resumed, *pinned, *in_use}
    assert not (must_keep & set(plan.delete))
    if policy is None:
        assert plan.delete == []
    else:
        assert set(plan.delete) == steps - policy.keep(cps) - must_keep
    shuffled = list(cps)
    rnd.shuffle(shuffled)
    assert plan_prune(shuffled, policy, **kw) == plan


@given(checkpoint_lists(), policies, st.randoms())
def test_plan_prune_keeps_the_step_just_committed_and_all_above_it(cps, policy, rnd):
    """Issue 28 item 4: the prune after a commit (committed_step) never deletes that step,
    nor any step above it (allow_older_steps: another timeline's); the policy decides over
    the steps up to it as if those above were absent. Forward-only runs: no change."""
    if not cps:
        return
    committed = rnd.choice(cps).step
    plan = plan_prune(cps, policy, tracker_step=max(c.step for c in cps), committed_step=committed)
    assert committed not in plan.delete and "just-committed" in plan.keep[committed]
    assert all(s < committed for s in plan.delete)
    below = [c for c in cps if c.step <= committed]
    assert set(plan.delete) == {c.step for c in below} - policy.keep(below) - {committed}
    newest = max(c.step for c in cps)
    forward = plan_prune(cps, policy, tracker_step=newest, committed_step=newest)
    assert forward.delete == plan_prune(cps, policy, tracker_step=newest).delete


def test_plan_prune_with_a_stale_higher_step():
    cps = [ck(1000), ck(10), ck(20), ck(30)]
    plan = plan_prune(cps, KeepLast(1), tracker_step=1000, committed_step=30)
    assert plan.delete == [10, 20]
    assert plan.keep == {
        30: ["just-committed", "KeepLast(1)"],
        1000: ["newest", "tracker", "above-just-committed"],
    }
    # Without committed_step (the CLI's prune), the policy ranks every step, 1000 first.
    assert plan_prune(cps, KeepLast(1), tracker_step=1000).delete == [10, 20, 30]


def test_plan_prune_reasons():
    cps = [ck(s, loss=float(s % 7)) for s in range(1, 11)]
    plan = plan_prune(
        cps,
        KeepLast(2) | KeepBest(1, "loss"),
        tracker_step=10,
        resumed_from=3,
        pinned=[4],
        in_use=[5, 10],
    )
    assert plan.keep == {
        3: ["resumed-from"],
        4: ["protected"],
        5: ["in-use"],
        7: ["KeepBest(1, 'loss')"],
        9: ["KeepLast(2)"],
        10: ["newest", "tracker", "in-use", "KeepLast(2)"],
    }
    assert plan.delete == [1, 2, 6, 8]
    assert protected_steps(cps, tracker_step=99, resumed_from=None) == {10: ["newest"]}


def test_fifty_steps_keep_last_three_or_best_loss():
    loss = {s: (s - 17) ** 2 / 100 + 0.5 for s in range(1, 51)}
    cps = [CheckpointInfo(s, 1000.0 + s, {"loss": loss[s]}, 10) for s in range(1, 51)]
    random.Random(0).shuffle(cps)
    plan = plan_prune(cps, KeepLast(3) | KeepBest(1, "loss"), tracker_step=50)
    best = min(loss, key=loss.get)
    expected = {48, 49, 50, best}
    assert best == 17
    assert set(plan.keep) == expected
    assert plan.delete == [s for s in range(1, 51) if s not in expected]


def test_plan_prune_scope_run():
    cps = [ck(1, run_id="old"), ck(2, run_id="old"), ck(3, run_id="me"), ck(4, run_id="me"), ck(5)]
    cps.append(ck(6, run_id="me"))
    plan = plan_prune(cps, KeepLast(1), tracker_step=6, run_id="me", scope="run")
    assert plan.delete == [3, 4]
    assert plan.keep[1] == ["other-run"] and plan.keep[5] == ["other-run"]
    assert plan_prune(cps, KeepLast(1), tracker_step=6).delete == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="run_id"):
        plan_prune(cps, KeepLast(1), scope="run")
    with pytest.raises(ValueError, match="scope"):
        plan_prune(cps, KeepLast(1), scope="mine")
    with pytest.raises(ValueError, match="duplicate"):
        plan_prune([ck(1), ck(1)], KeepLast(1))
    with pytest.raises(TypeError):
        plan_prune(cps, "KeepLast(1)")


# -- multi-rank ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rank, local_rank, storage, expected",
    [
        (0, 0, "shared", True),
        (8, 0, "shared", False),
        (3, 3, "shared", False),
        (0, 0, "local", True),
        (8, 0, "local", True),
        (9, 1, "local", False),
    ],
)
def test_should_prune_table(rank, local_rank, storage, expected):
    assert should_prune(rank, local_rank, storage) is expected


@pytest.mark.parametrize(
    "args, exc",
    [((0, 0, "nfs"), ValueError), ((-1, 0, "shared"), ValueError), ((0, "0", "local"), TypeError)],
)
def test_should_prune_validates(args, exc):
    with pytest.raises(exc):
        should_prune(*args)


# -- save schedule ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_schedule_every_steps():
    s = SaveSchedule(every_steps=10)
    assert [step for step in range(0, 35) if s.should_save(step)] == [10, 20, 30]
    assert not s.should_save(30)  # asked twice for one step: one save
    assert s.should_save(31, force=True)
    assert not SaveSchedule().should_save(10)


def test_schedule_every_seconds_window_restarts():
    clock = FakeClock()
    s = SaveSchedule(every_seconds=60, clock=clock)
    assert not s.should_save(1)  # window starts at the first question
    clock.now = 59.9
    assert not s.should_save(2)
    clock.now = 60.0
    assert s.should_save(3)
    clock.now = 100.0
    assert not s.should_save(4)
    clock.now = 120.0
    assert s.should_save(5)
    s.mark_saved(6)
    clock.now = 179.0
    assert not s.should_save(7)
    clock.now = 180.0
    assert s.should_save(8)


def test_schedule_whichever_first():
    clock = FakeClock()
    s = SaveSchedule(every_steps=100, every_seconds=30, clock=clock)
    answers = []
    for step in range(1, 301):
        clock.now = step - 1.0  # one second per step, window opens at step 1
        if step == 150:
            clock.now = 10_000  # a slow step: time fires here
        elif step > 150:
            clock.now = 10_000 + (step - 150) * 0.1  # fast steps: step trigger fires first
        if s.should_save(step):
            answers.append(step)
    assert answers == [31, 61, 91, 100, 130, 150, 200, 300]


def test_schedule_validates():
    for kw, exc in [
        ({"every_steps": 0}, ValueError),
        ({"every_steps": 2.5}, TypeError),
        ({"every_seconds": -1}, ValueError),
        ({"every_seconds": "60"}, TypeError),
        ({"clock": 3}, TypeError),
    ]:
        with pytest.raises(exc):
            SaveSchedule(**kw)


def test_preemption_request_answers_once():
    s = SaveSchedule(every_steps=1000)
    s.request_preemption_save()
    s.request_preemption_save()  # coalesced: still one save
    assert s.preemption_requested
    assert s.should_save(7)
    assert not s.preemption_requested
    assert not s.should_save(8)


def test_policies_pickle_for_the_worker_process():
    """The engine ships the policy to its worker process with each prune request."""
    import pickle

    p = KeepLast(3) | KeepBest(1, "loss", mode="max") | KeepSteps([5]) | KeepInterval(60.0)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and repr(q) == repr(p)
    cps = [ck(s, loss=float(s)) for s in range(10)]
    assert q.keep(cps) == p.keep(cps)
