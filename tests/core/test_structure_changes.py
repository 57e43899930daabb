"""One engine saving states whose structure changes between saves writes each one as a
fresh writer would: every cache of a plan or layout (``asyncckpt/core/cachekeys.py``) is keyed by
everything it depends on.

Two silent corruptions came from caches keyed by less: DCP's plan cache wrote the old dtype
into ``.metadata`` after a dtype change, and the flatten plan's replay kept a list's paths
after it became an int-keyed dict. The property test below generates what found them.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from statecmp import assert_same
from torch.distributed.checkpoint import FileSystemReader

from asyncckpt import SyncCheckpointEngine, read_checkpoint

# (before, after) dtype changes of one tensor whose shape stays, as seen in the field: a model
# cast between saves, a counter that becomes a float, fp8 scales.
DTYPE_CHANGES = [
    (torch.int64, torch.float64),
    (torch.float32, torch.int32),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.uint8, torch.float8_e5m2),
]


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _metadata(directory: Any) -> dict[str, Any]:
    return FileSystemReader(str(directory)).read_metadata().state_dict_metadata


def _plain_dcp_metadata(state: dict, directory: Any) -> dict[str, Any]:
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return _metadata(directory)


def test_a_dtype_change_between_saves_is_written_with_the_new_dtype(tmp_path):
    def state(i: int) -> dict:
        out: dict[str, Any] = {"same": torch.zeros(3)}  # a key whose plan does not change
        for n, pair in enumerate(DTYPE_CHANGES):
            out[f"t{n}"] = _values(pair[i], (4,), n)
        out["scalar"] = _values((torch.float32, torch.float64)[i], (), 9)
        return out

    first, second = state(0), state(1)
    with SyncCheckpointEngine(tmp_path / "r", keep=None) as engine:
        engine.save(1, first)
        engine.save(2, second)
        engine.wait()
        target = {k: torch.zeros_like(v) for k, v in second.items()}
        assert engine.load(target, step=2) == 2
    assert_same(target, second)
    ours = _metadata(tmp_path / "r" / "global_step_2")
    assert ours == _plain_dcp_metadata(second, tmp_path / "plain")
    assert_same(read_checkpoint(tmp_path / "r" / "global_step_2"), second)
    plain_target = {k: torch.zeros_like(v) for k, v in second.items()}
    dcp.load(plain_target, checkpoint_id=str(tmp_path / "r" / "global_step_2"), no_dist=True)
    assert_same(plain_target, second)


@pytest.mark.parametrize("direction", ["list->dict", "dict->list"])
def test_a_list_replaced_by_an_int_keyed_dict_is_written_as_the_new_structure(tmp_path, direction):
    as_list = {"x": [torch.zeros(2), torch.ones(2)], "y": torch.zeros(1)}
    as_dict = {"x": {0: torch.zeros(2), 1: torch.ones(2)}, "y": torch.zeros(1)}
    first, second = (as_list, as_dict) if direction == "list->dict" else (as_dict, as_list)
    with SyncCheckpointEngine(tmp_path / "r", keep=None) as engine:
        engine.save(1, first)
        engine.save(2, second)
        engine.wait()
    assert_same(read_checkpoint(tmp_path / "r" / "global_step_2"), second)
    assert_same(read_checkpoint(tmp_path / "r" / "global_step_1"), first)


# ------------------------------------------------------------------------ generated states

# A state's structure as data: ("dict", {str: node}), ("idict", {int: node}),
# ("list", [node]), ("tensor", dtype, shape, view), ("obj", value). States are built from it
# with fresh values, so a structure can be mutated and built again.

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e5m2,
]
SHAPES = [(), (0,), (1,), (3,), (2, 3), (4, 2)]
VIEWS = ["plain", "slice", "transpose"]
KEYS = ["a", "b", "c", "d"]

dtypes = st.sampled_from(DTYPES)
shapes = st.sampled_from(SHAPES)
tensor_nodes = st.tuples(st.just("tensor"), dtypes, shapes, st.sampled_from(VIEWS))
object_nodes = st.tuples(st.just("obj"), st.one_of(st.integers(-5, 5), st.text(max_size=3)))
leaves = st.one_of(tensor_nodes, tensor_nodes, object_nodes)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.just("dict"), st.dictionaries(st.sampled_from(KEYS), children, max_size=3)),
        st.tuples(
            st.just("idict"), st.dictionaries(st.integers(0, 3), children, min_size=1, max_size=3)
        ),
        st.tuples(st.just("list"), st.lists(children, min_size=1, max_size=3)),
    )


nodes = st.recursive(leaves, _containers, max_leaves=8)
roots = st.tuples(
    st.just("dict"),
    st.dictionaries(st.sampled_from(KEYS), nodes, max_size=3).map(
        lambda d: {**d, "anchor": ("tensor", torch.float32, (2,), "plain")}
    ),
)


def build(node: tuple, seed: itertools.count) -> Any:
    """A state with fresh values for the structure ``node``."""
    kind = node[0]
    if kind in ("dict", "idict"):
        return {k: build(v, seed) for k, v in node[1].items()}
    if kind == "list":
        return [build(v, seed) for v in node[1]]
    if kind == "obj":
        return node[1]
    _, dtype, shape, view = node
    if view == "slice" and shape:
        base = _values(dtype, (shape[0] + 2, *shape[1:]), next(seed))
        return base[1 : 1 + shape[0]]
    if view == "transpose" and len(shape) == 2:
        return _values(dtype, shape[::-1], next(seed)).t()
    return _values(dtype, shape, next(seed))


def zeros_like_state(state: Any) -> Any:
    """A load target of the same structure (contiguous tensors; objects kept)."""
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in state):
        return [zeros_like_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    return state


@st.composite
def mutated(draw: Any, node: tuple) -> tuple:
    """``node`` with one change a training run makes between saves."""
    kind = node[0]
    if kind == "tensor":
        _, dtype, shape, view = node
        change = draw(st.sampled_from(["dtype", "shape", "view", "to_object"]))
        if change == "dtype":
            return ("tensor", draw(dtypes.filter(lambda d: d != dtype)), shape, view)
        if change == "shape":
            return ("tensor", dtype, draw(shapes.filter(lambda s: s != shape)), view)
        if change == "view":
            return ("tensor", dtype, shape, draw(st.sampled_from(VIEWS)))
        return draw(object_nodes)
    if kind == "obj":
        return draw(tensor_nodes)
    children = dict(node[1]) if kind != "list" else dict(enumerate(node[1]))
    change = draw(st.sampled_from(["child", "child", "retype", "add", "remove"]))
    if change == "child" and children:
        k = draw(st.sampled_from(sorted(children, key=str)))
        children[k] = draw(mutated(children[k]))
    elif change == "retype":  # a list becomes an int-keyed dict of the same keys, or back
        if kind == "list":
            return ("idict", children)
        if kind == "idict" and sorted(children) == list(range(len(children))):
            return ("list", [children[i] for i in range(len(children))])
        return ("dict", {str(k): v for k, v in children.items()})
    elif change == "add":
        new = draw(leaves)
        if kind == "list":
            return ("list", [*node[1], new])
        children[draw(st.sampled_from(KEYS)) if kind == "dict" else len(children) + 5] = new
    elif change == "remove" and len(children) > 1:
        children.pop(draw(st.sampled_from(sorted(children, key=str))))
        if kind == "list":
            return ("list", list(children.values()))
    if kind == "list":
        return ("list", [children[i] for i in sorted(children)])
    return (kind, children)


def _mutated_root(draw: Any, root: tuple) -> tuple:
    new = draw(mutated(root))
    if new[0] != "dict":  # the root stays a dict of named components
        new = ("dict", {str(k): v for k, v in new[1].items()} if new[0] == "idict" else {})
    return ("dict", {**new[1], "anchor": root[1]["anchor"]})


def _empty_dict_leaves(state: Any, prefix: str = "") -> set[str]:
    """fqns of empty dicts below the root (kept as leaves by asyncckpt, dropped by DCP)."""
    out: set[str] = set()
    items: Any = state.items() if isinstance(state, dict) else ()
    if isinstance(state, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in state):
        items = enumerate(state)
    for k, v in items:
        fqn = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and not v:
            out.add(fqn)
        else:
            out |= _empty_dict_leaves(v, fqn)
    return out


def check_step(root: Any, step: int, state: dict, engine: Any, scratch: Any) -> None:
    """Step ``step`` in ``root`` holds ``state``, as every reader sees it, with the
    ``.metadata`` plain ``dcp.save`` writes for it."""
    directory = root / f"global_step_{step}"
    ours = _metadata(directory)
    plain = _plain_dcp_metadata(state, scratch)
    for fqn, md in plain.items():
        assert ours.get(fqn) == md, (fqn, ours.get(fqn), md)
    assert set(ours) - set(plain) <= _empty_dict_leaves(state), set(ours) ^ set(plain)
    assert_same(read_checkpoint(directory), state)
    target = zeros_like_state(state)
    assert engine.load(target, step=step) == step
    assert_same(target, state)
    # Plain DCP reads the keys its target asks for. Known limit: an empty dict kept as a leaf
    # is a key DCP's own save drops, and its presence makes dcp.load flatten the target the
    # pre-2.4 way, which fails beside a nested dict of plain values (README, compatibility).
    if plain and not _empty_dict_leaves(state):
        dcp_target = zeros_like_state(state)
        dcp.load(dcp_target, checkpoint_id=str(directory), no_dist=True)
        # Tensors only: DCP's own round trip of a plain value in an int-keyed dict adds a str
        # key beside the int one (on its own checkpoints too).
        assert_same(_tensors_along(dcp_target, state), _tensors_along(state, state))


def _tensors_along(got: Any, like: Any, prefix: str = "") -> dict[str, Any]:
    """The tensors of ``got`` at the places ``like`` holds tensors, by path."""
    if isinstance(like, torch.Tensor):
        return {prefix: got}
    items: Any = like.items() if isinstance(like, dict) else ()
    if isinstance(like, list):
        items = enumerate(like)
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_tensors_along(got[k], v, f"{prefix}.{k}"))
    return out


def test_one_engine_writes_every_generated_structure_as_plain_dcp_does(tmp_path):
    steps = itertools.count(1)
    scratch = itertools.count()
    root = tmp_path / "r"
    with SyncCheckpointEngine(root, keep=None) as engine:

        @settings(
            max_examples=15,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(data=st.data())
        def run(data: Any) -> None:
            structure = data.draw(roots)
            seeds = itertools.count(data.draw(st.integers(0, 1000)))
            for _ in range(data.draw(st.integers(2, 4))):
                state = build(structure, seeds)
                step = next(steps)
                engine.save(step, state)
                engine.wait()
                check_step(root, step, state, engine, tmp_path / f"plain{next(scratch)}")
                structure = _mutated_root(data.draw, structure)

        run()
