"""The engine's options, grouped (issue 23, item 3): one object per behaviour with several
knobs; the flat keywords they replaced still work, with a DeprecationWarning naming the
replacement; wrong types are refused when the engine is made."""

from __future__ import annotations

import inspect
import warnings

import pytest

from asyncckpt import (
    CheckpointEngine,
    Distributed,
    KeepLast,
    MemoryTier,
    ObjectStore,
    Preemption,
    Retention,
    Schedule,
    Staging,
    SyncCheckpointEngine,
    ThrottleConfig,
)
from asyncckpt.options import DEPRECATED, resolve_options


def test_the_common_case_is_a_one_liner_with_no_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = CheckpointEngine(tmp_path, keep=KeepLast(3))
    assert engine.rank == 0 and engine.world_size == 1
    assert engine.throttle == ThrottleConfig.background()


# A flat keyword, a value, and what it must become.
FLAT = [
    ("save_every_steps", 7, lambda o: o.schedule == Schedule(every_steps=7)),
    ("save_every_seconds", 2.5, lambda o: o.schedule == Schedule(every_seconds=2.5)),
    ("prune_scope", "run", lambda o: o.retention == Retention(scope="run")),
    ("keep_resumed", "run", lambda o: o.retention == Retention(keep_resumed="run")),
    ("rank", 0, lambda o: o.distributed == Distributed(rank=0)),
    ("world_size", 1, lambda o: o.distributed == Distributed(world_size=1)),
    ("local_rank", 3, lambda o: o.distributed == Distributed(local_rank=3)),
    ("store", ("h", 5), lambda o: o.distributed == Distributed(store=("h", 5))),
    ("dist_timeout", 60, lambda o: o.distributed == Distributed(timeout=60)),
    ("storage", "local", lambda o: o.distributed == Distributed(storage="local")),
    ("legacy_ranks", {"tp": 1}, lambda o: o.distributed == Distributed(legacy_ranks={"tp": 1})),
    ("handle_sigterm", False, lambda o: o.preemption == Preemption(handle_sigterm=False)),
    ("preemption_save", True, lambda o: o.preemption == Preemption(final_save=True)),
    ("storage_options", {"a": 1}, lambda o: o.object_store == ObjectStore({"a": 1})),
    ("spool", "/sp", lambda o: o.object_store == ObjectStore(spool="/sp")),
    (
        "persist_memory_on_close",
        True,
        lambda o: o.memory == MemoryTier(persist_on_close=True),
    ),
    (
        "optimizer_offload",
        True,
        lambda o: o.throttle == ThrottleConfig.for_optimizer_offload(),
    ),
    (
        "durable_within",
        30.0,
        lambda o: o.throttle == ThrottleConfig.background(durable_within=30.0),
    ),
    ("max_in_flight", 2, lambda o: o.staging == Staging(max_in_flight=2)),
    (
        "allow_older_steps",
        True,
        lambda o: o.retention == Retention(allow_older_steps=True),
    ),
    (
        "write_timeout",
        5.0,
        lambda o: (
            o.throttle == ThrottleConfig.background(write_timeout=5.0) and o.write_timeout == 5.0
        ),
    ),
]


def test_every_deprecated_keyword_is_tested():
    assert sorted(name for name, _, _ in FLAT) == sorted(DEPRECATED)


@pytest.mark.parametrize("name, value, check", FLAT, ids=[f[0] for f in FLAT])
def test_a_flat_keyword_warns_naming_its_replacement_and_still_works(name, value, check):
    with pytest.warns(DeprecationWarning) as caught:
        opts = resolve_options({}, {name: value})
    message = str(caught[0].message)
    group = DEPRECATED[name][0]
    assert f"{name}=" in message and f"{group}=" in message, message
    assert check(opts)


def test_the_warning_points_at_the_callers_line(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"schedule=Schedule\(every_steps") as caught:
        engine = SyncCheckpointEngine(tmp_path, save_every_steps=2)
    assert caught[0].filename == __file__
    assert engine.should_save(2) and not engine.should_save(3)


def test_deprecated_rank_keywords_reach_the_engine(tmp_path):
    with pytest.warns(DeprecationWarning):
        engine = CheckpointEngine(tmp_path, rank=0, world_size=1, handle_sigterm=False)
    assert (engine.rank, engine.world_size) == (0, 1)


def test_a_flat_keyword_and_its_group_together_are_refused(tmp_path):
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="not both"):
        CheckpointEngine(tmp_path, schedule=Schedule(every_steps=2), save_every_steps=3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"schedule": 5}, r"schedule= takes Schedule"),
        ({"retention": "run"}, r"retention= takes Retention"),
        ({"distributed": {"rank": 0}}, r"distributed= takes Distributed"),
        ({"preemption": False}, r"preemption= takes Preemption"),
        ({"object_store": {"spool": "x"}}, r"object_store= takes ObjectStore"),
        ({"memory": {"persist_on_close": True}}, r"memory= takes MemoryTier"),
        ({"staging": 2}, r"staging= takes Staging"),
        ({"throttle": "offload"}, r"throttle must be a ThrottleConfig"),
        ({"save_evry_steps": 5}, r"unexpected keyword argument\(s\) \['save_evry_steps'\]"),
    ],
)
def test_wrong_types_are_refused_when_the_engine_is_made(tmp_path, kwargs, match):
    with pytest.raises(TypeError, match=match):
        CheckpointEngine(tmp_path, **kwargs)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Schedule(every_steps=0), "every_steps"),
        (lambda: Schedule(every_seconds="5"), "every_seconds"),
        (lambda: Retention(scope="some"), "scope"),
        (lambda: Retention(keep_resumed="forever"), "keep_resumed"),
        (lambda: Distributed(rank=-1), "rank"),
        (lambda: Distributed(store="host:1"), "store"),
        (lambda: Distributed(timeout=0), "timeout"),
        (lambda: Distributed(storage="nfs"), "storage"),
        (lambda: Preemption(handle_sigterm="yes"), "handle_sigterm"),
        (lambda: ObjectStore(storage_options=[1]), "storage_options"),
        (lambda: MemoryTier(persist_on_close=1), "persist_on_close"),
        (lambda: Distributed(node_rank=-1), "node_rank"),
        (lambda: Distributed(ranks_per_node=0), "ranks_per_node"),
        (lambda: Staging(max_in_flight=0), "max_in_flight"),
        (lambda: Staging(max_in_flight=True), "max_in_flight"),
        (lambda: Staging(max_host_bytes=0), "max_host_bytes"),
        (lambda: Staging(max_host_bytes=1.5), "max_host_bytes"),
        (lambda: Staging(max_host_bytes=100), "max_host_bytes"),  # below two chunk buffers
        (lambda: Retention(allow_older_steps="yes"), "allow_older_steps"),
        (lambda: ThrottleConfig(write_timeout=0), "write_timeout"),
    ],
)
def test_each_group_checks_its_fields(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def test_the_engine_takes_at_most_16_keyword_options():
    """Issue 36 item 4: knobs go into option objects, not beside them (``root`` and the
    deprecated ``**flat`` keywords are not options)."""
    params = inspect.signature(CheckpointEngine.__init__).parameters.values()
    options = [p.name for p in params if p.name not in ("self", "root") and p.kind != p.VAR_KEYWORD]
    assert len(options) <= 16, options
    assert "staging" in options and "max_in_flight" not in options


def test_a_flat_keyword_beside_its_new_group_is_refused(tmp_path):
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="not both"):
        CheckpointEngine(tmp_path, staging=Staging(), max_in_flight=2)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="not both"):
        CheckpointEngine(tmp_path, throttle=ThrottleConfig.off(), write_timeout=5)


def test_object_store_is_only_for_a_url_root(tmp_path):
    with pytest.raises(ValueError, match="object_store= .* is for a URL root"):
        CheckpointEngine(tmp_path, object_store=ObjectStore(spool=tmp_path / "s"))


def test_both_facades_share_one_save_signature_and_one_option_list(tmp_path):
    a = inspect.signature(CheckpointEngine.save)
    s = inspect.signature(SyncCheckpointEngine.save)
    assert list(a.parameters) == list(s.parameters)
    assert inspect.signature(CheckpointEngine.__init__) == inspect.signature(
        SyncCheckpointEngine.__init__
    )
    with SyncCheckpointEngine(tmp_path) as engine:
        with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['overlapp'\]"):
            engine.save(1, {}, overlapp=True)


def test_lightnings_defaults_are_one_rank_and_no_sigterm_handler_unless_given():
    """Lightning's plugin writes as one rank and leaves SIGTERM to Lightning; a user's own
    objects (or the flat keywords of before) still win where they say something."""
    pytest.importorskip("lightning")
    from asyncckpt.integrations.lightning import _lightning_defaults

    d = _lightning_defaults({})
    assert d["distributed"] == Distributed(world_size=1)
    assert d["preemption"] == Preemption(handle_sigterm=False)
    mine = _lightning_defaults({"distributed": Distributed(rank=0, timeout=5)})
    assert mine["distributed"] == Distributed(rank=0, world_size=1, timeout=5)
    assert _lightning_defaults({"preemption": Preemption()})["preemption"] == Preemption()
    assert _lightning_defaults({"rank": 0})["world_size"] == 1


# -- nodes (issue 33 item 2): from torchrun's environment or Distributed(...) ------------------


@pytest.mark.parametrize(
    "rank, world, local, node_rank, per_node, env, expected",
    [
        (0, 1, 0, None, None, {}, (0, 1)),  # one process: one node
        (3, 4, 3, None, None, {}, (0, 4)),  # local rank = rank: every rank on one node
        (3, 4, 1, None, None, {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 2)),  # torchrun
        (5, 6, 1, 2, 2, {}, (2, 2)),  # explicit, 3 nodes x 2 ranks
        (5, 6, 1, 2, 2, {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "6"}, (2, 2)),  # explicit wins
        (2, 4, 0, None, None, {}, None),  # several nodes, their size unknown
    ],
)
def test_a_ranks_node_comes_from_torchrun_or_distributed(
    monkeypatch, rank, world, local, node_rank, per_node, env, expected
):
    from asyncckpt.cluster.dist import Node, detect_node

    for name in ("GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    got = detect_node(rank, world, local, node_rank, per_node)
    assert got == (None if expected is None else Node(*expected))


@pytest.mark.parametrize(
    "args, match",
    [
        ((3, 4, 1, 1, 3), "does not divide"),
        ((3, 4, 1, 2, 2), "out of range"),
        ((3, 4, 0, 1, 2), "is not local rank 0 of node 1"),  # rank 3 is local rank 1 there
        ((3, 4, 1, 1, None), "go together"),
    ],
)
def test_a_node_layout_torchrun_would_not_make_is_refused(monkeypatch, args, match):
    from asyncckpt.cluster.dist import detect_node

    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=match):
        detect_node(*args)


def test_the_engine_says_its_node(tmp_path, monkeypatch):
    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    engine = CheckpointEngine(
        tmp_path,
        distributed=Distributed(rank=3, world_size=4, local_rank=1, node_rank=1, ranks_per_node=2),
    )
    assert (engine.node_rank, engine.nodes) == (1, 2)
    assert (CheckpointEngine(tmp_path).node_rank, CheckpointEngine(tmp_path).nodes) == (0, 1)
    with pytest.raises(ValueError, match="is not local rank"):
        CheckpointEngine(
            tmp_path, distributed=Distributed(rank=2, world_size=4, local_rank=1, ranks_per_node=2,
                                              node_rank=0)
        )  # fmt: skip
