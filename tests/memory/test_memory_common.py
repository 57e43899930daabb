"""Several ranks, memory tier: which step each worker keeps, and which one the workers write
when the trainers are gone (issue 32 item 4). The pure decisions (memory_hold.fate, let_go,
newest_common) and memory_tier.Agreement over a store in a dict, run as a model of every
rank's saves in any order hypothesis draws, with trainers killed at any point."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt.cluster.dist import DistConfig
from asyncckpt.memory import tier as memory_tier
from asyncckpt.memory.hold import COMMON, DROPPED, fate, let_go, newest_common


def test_newest_common_is_the_newest_step_in_every_set():
    steps = range(4)
    sets = [frozenset(c) for n in range(3) for c in itertools.combinations(steps, n)]
    for world in (1, 2, 3):
        for held in itertools.product(sets, repeat=world):
            both = [s for s in steps if all(s in h for h in held)]
            assert newest_common(list(held)) == (max(both) if both else None)
    assert newest_common([]) is None
    # The issue's case: rank 0 holds 17, rank 1 18 and 19: nothing in common.
    assert newest_common([{17}, {18, 19}]) is None
    assert newest_common([{16, 17}, {17, 19}]) == 17


def test_a_common_step_is_evicted_only_for_a_newer_common_one():
    assert fate(2, 2) == fate(3, 2) == COMMON
    assert fate(1, 2) == fate(0, 4) == DROPPED
    assert let_go(16, 17, COMMON) == 16  # 17 is on every rank: the older goes
    assert let_go(17, 18, DROPPED) == 18  # 18 is not: 17 stays


class DictStore:
    """What Agreement uses of a TCPStore: add, compare_set, delete_key."""

    def __init__(self) -> None:
        self.d: dict[str, str] = {}

    def add(self, key: str, n: int) -> int:
        v = int(self.d.get(key, "0")) + n
        self.d[key] = str(v)
        return v

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        cur = self.d.get(key)
        if (cur is None and expected == "") or cur == expected:
            self.d[key] = desired
            return desired.encode()
        return (expected if cur is None else cur).encode()

    def delete_key(self, key: str) -> bool:
        return self.d.pop(key, None) is not None


@dataclass
class Rank:
    """One rank's trainer and worker, as memory_tier.save moves them: ``kept`` and ``held``."""

    agreement: memory_tier.Agreement
    kept: int | None = None
    held: int | None = None
    step: int = 1  # the next memory save
    phase: str = "barrier"  # barrier -> room -> hold -> barrier ...
    dead: bool = False
    returned: list[int] = field(default_factory=list)

    def holds(self) -> set[int]:
        return {s for s in (self.kept, self.held) if s is not None}


def run_model(world: int, steps: int, choices: list[int], lockstep: bool) -> None:
    store = DictStore()
    ranks = []
    for r in range(world):
        agreement = memory_tier.Agreement(DistConfig(r, world, r, "model", 0, "tok"))
        agreement.store = store
        ranks.append(Rank(agreement))
    agreed: dict[int, bool] = {}

    def enabled(rank: Rank) -> bool:
        if rank.dead or rank.step > steps:
            return False
        if rank.phase == "barrier":  # the training's collective before each save
            return (
                not lockstep
                or any(o.dead for o in ranks)
                or all(rank.step - 1 in o.returned or rank.step == 1 for o in ranks)
            )
        if rank.phase == "room" and rank.kept is not None and rank.held is not None:
            # Agreement.common waits for a live peer's hand-off (COMMON_WAIT_S); not for a
            # dead one's. Without lockstep, any order: the wait may run out first.
            return not lockstep or all(o.dead or rank.held in o.returned for o in ranks)
        return True

    for choice in choices:
        live = [r for r in ranks if enabled(r)]
        if not live:
            break
        if choice < 0:  # a trainer SIGKILLed here (its worker keeps what it holds)
            ranks[-choice % world].dead = True
            continue
        rank = live[choice % len(live)]
        if rank.phase == "barrier":
            rank.phase = "room"
        elif rank.phase == "room":
            if rank.kept is not None and rank.held is not None:  # _make_room
                common = rank.agreement.common(rank.held)
                agreed[rank.held] = common
                gone = let_go(rank.kept, rank.held, COMMON if common else DROPPED)
                rank.kept = rank.held if gone == rank.kept else rank.kept
                rank.held = None
            rank.phase = "hold"
        else:  # Hold(step, keep=the other), counted, save() returns
            if rank.kept is None:
                rank.kept = rank.held
            rank.held = rank.step
            rank.agreement.handed_off(rank.step)
            rank.returned.append(rank.step)
            rank.step += 1
            rank.phase = "barrier"
        assert len(rank.holds()) <= 2
    # Every trainer is dead now: what the workers write.
    held = [r.holds() for r in ranks]
    written = newest_common(held)
    assert written is None or all(written in h for h in held)  # never a mix
    # A step agreed common is never evicted before a newer one is common.
    newest_agreed = max((s for s, c in agreed.items() if c), default=None)
    if newest_agreed is not None:
        assert written is not None and written >= newest_agreed, (held, agreed)
    if lockstep:
        # The newest step whose save() returned on every rank, or a newer one, is written.
        everywhere = min(max(r.returned, default=0) for r in ranks)
        if everywhere:
            assert written is not None and written >= everywhere, (held, everywhere)


@pytest.fixture(autouse=True)
def no_wait(monkeypatch):
    monkeypatch.setattr(memory_tier, "COMMON_WAIT_S", 0.0)  # the model orders the waits


@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(2, 4),
    steps=st.integers(1, 6),
    choices=st.lists(st.integers(-4, 8), max_size=80),
    lockstep=st.booleans(),
)
def test_model_of_every_order_of_saves_and_kills(world, steps, choices, lockstep):
    run_model(world, steps, choices, lockstep)


def test_the_issue_case():
    """Rank 0 dies right after step 3 returned everywhere; rank 1 returns 4 and 5."""
    # Both save 1..3 in lockstep (0 then 1 each phase), then rank 0 dies, rank 1 goes on.
    lock = [0, 1] * 3 * 3
    run_model(2, 5, [*lock, -2, 0, 0, 0, 0, 0, 0], lockstep=True)
