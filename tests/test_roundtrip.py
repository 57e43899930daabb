"""State round-trips through the engine, for every format (issue 11): empty containers, an
optimizer's int-keyed state loaded into a fresh optimizer, lists of plain values, and modules
restored in place by the legacy per-rank format."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from statecmp import assert_same

from asyncckpt import CheckpointError, Preemption, SyncCheckpointEngine
from asyncckpt.core import layout as L

#: (layout, format) of every format the engine writes; None: the layout's default.
FORMATS = [("global_step", None), ("megatron", None), ("megatron", "torch")]
FORMAT_IDS = ["dcp", "torch_dist", "megatron_legacy"]


def _engine(root: Path, layout: str, fmt: str | None) -> SyncCheckpointEngine:
    kw = {"format": fmt} if fmt else {}
    return SyncCheckpointEngine(
        root, layout=layout, preemption=Preemption(handle_sigterm=False), **kw
    )


def _model_and_optimizer(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(5, 4)).square().sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


@pytest.mark.parametrize(("layout", "fmt"), FORMATS, ids=FORMAT_IDS)
def test_optimizer_before_its_first_step_round_trips(tmp_path: Path, layout, fmt) -> None:
    """AdamW before step() has ``state: {}``; the empty dict must come back (the README's
    Quick start, run twice, failed with KeyError 'state' on dcp)."""
    model, optim = _model_and_optimizer(0, steps=0)
    assert optim.state_dict()["state"] == {}
    extra = {"empty": {}, "none": [], "nested": {"a": {"b": {}}, "c": [], "n": 1}}
    with _engine(tmp_path, layout, fmt) as engine:
        engine.save(10, {"model": model, "optim": optim, "extra": extra})
    model2, optim2 = _model_and_optimizer(1, steps=0)
    target = {"model": model2, "optim": optim2, "extra": {}}
    assert _engine(tmp_path, layout, fmt).load_latest(target) == 10
    assert_same(optim2.state_dict(), optim.state_dict())
    assert_same(model2.state_dict(), model.state_dict())
    assert_same(target["extra"], extra)
    # And the restored optimizer still works.
    model2(torch.randn(2, 4)).sum().backward()
    optim2.step()


def test_empty_containers_in_a_plain_state_dcp(tmp_path: Path) -> None:
    """Empty dicts and lists anywhere, also inside a list that holds tensors."""
    state = {
        "w": torch.arange(3.0),
        "a": {},
        "b": {"c": {}, "d": [], "e": {"f": {}}},
        "mixed": [torch.ones(2), {}, [], {"g": {}}],
    }
    with _engine(tmp_path, "global_step", None) as engine:
        engine.save(1, state)
    target = {"w": torch.zeros(3), "mixed": [torch.zeros(2), {}, [], {}]}
    assert _engine(tmp_path, "global_step", None).load_latest(target) == 1
    assert_same(target, state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_load_still_reads_a_state_with_empty_parts(tmp_path: Path) -> None:
    """Recording empty containers must not stop plain ``dcp.load`` (no asyncckpt) from
    reading the non-empty parts."""
    import torch.distributed.checkpoint as dcp

    model, optim = _model_and_optimizer(0, steps=0)
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "cfg": {"n": 3, "e": {}}}
    with _engine(tmp_path, "global_step", None) as engine:
        engine.save(1, state)
    model2, optim2 = _model_and_optimizer(1, steps=0)
    target = {"model": model2.state_dict(), "optim": optim2.state_dict(), "cfg": {"n": 0, "e": {}}}
    dcp.load(target, checkpoint_id=str(tmp_path / "global_step_1"), no_dist=True)
    assert_same(target["model"], model.state_dict())
    assert_same(target["optim"]["param_groups"], optim.state_dict()["param_groups"])
    assert target["cfg"]["n"] == 3


# --------------------------------------------------- 2. int-keyed optimizer state, lists


@pytest.mark.parametrize(("layout", "fmt"), FORMATS, ids=FORMAT_IDS)
def test_adamw_state_into_a_fresh_optimizer_bit_for_bit(tmp_path: Path, layout, fmt) -> None:
    """After a step AdamW's state is keyed by int param ids; a fresh optimizer (state {})
    must get every entry back, bit for bit, and the model its values in place."""
    model, optim = _model_and_optimizer(0, steps=2)
    assert len(optim.state_dict()["state"]) == 4
    with _engine(tmp_path, layout, fmt) as engine:
        engine.save(5, {"model": model, "optim": optim})
    model2, optim2 = _model_and_optimizer(1, steps=0)
    weight = model2[0].weight
    assert _engine(tmp_path, layout, fmt).load_latest({"model": model2, "optim": optim2}) == 5
    assert model2[0].weight is weight
    assert_same(model2.state_dict(), model.state_dict())
    assert_same(optim2.state_dict(), optim.state_dict())
    assert all(isinstance(k, int) for k in optim2.state_dict()["state"])


@pytest.mark.parametrize(("layout", "fmt"), FORMATS[:2], ids=FORMAT_IDS[:2])
def test_lists_of_values_replace_the_target_list(tmp_path: Path, layout, fmt) -> None:
    """A list of plain values comes back as saved (not merged over a longer target list, no
    IndexError over an empty one); a list of tensors of the same length is restored in place."""
    state = {
        "hist": [3, 1, 2],
        "grown": [3, 1, 2],
        "groups": [{"lr": 0.1, "params": [0, 1]}],
        "same_length": [{"lr": 0.1}, 2],
        "tensors": [torch.arange(3.0), torch.ones(2, dtype=torch.int64)],
    }
    with _engine(tmp_path, layout, fmt) as engine:
        engine.save(1, state)
    tensors = [torch.zeros(3), torch.zeros(2, dtype=torch.int64)]
    target = {
        "hist": [0, 1, 2, 3, 4, 5],
        "grown": [],
        "groups": [{"lr": 0.0, "params": [0, 1, 2]}, {"lr": 1.0, "params": [3]}],
        "same_length": [{"lr": 0.0, "momentum": 0.9}, 0],
        "tensors": list(tensors),
    }
    assert _engine(tmp_path, layout, fmt).load_latest(target) == 1
    assert_same(target, state)
    assert target["tensors"][0] is tensors[0] and target["tensors"][1] is tensors[1]


# ------------------------------------------------------- 3. legacy format: state dicts


def test_legacy_format_saves_state_dicts_and_restores_in_place(tmp_path: Path) -> None:
    model, optim = _model_and_optimizer(0, steps=1)
    with _engine(tmp_path, "megatron", "torch") as engine:
        engine.save(7, {"model": model, "optimizer": optim, "iteration": 7})
    # The file holds state dicts (as Megatron-LM's model_optim_rng.pt does), not pickled
    # objects: plain weights-only torch.load reads it.
    saved = torch.load(
        tmp_path / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True
    )
    assert_same(saved["model"], model.state_dict())
    assert_same(saved["optimizer"], optim.state_dict())
    model2, optim2 = _model_and_optimizer(1, steps=0)
    weight = model2[0].weight
    target = {"model": model2, "optimizer": optim2, "iteration": 0}
    assert _engine(tmp_path, "megatron", "torch").load_latest(target) == 7
    assert target["model"] is model2 and target["optimizer"] is optim2
    assert model2[0].weight is weight
    assert_same(model2.state_dict(), model.state_dict())
    assert_same(optim2.state_dict(), optim.state_dict())
    assert target["iteration"] == 7


class _Config:
    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Config) and other.n == self.n


@pytest.fixture
def main_class(monkeypatch):
    """``_Config`` as if the trainer's script had defined it (importable as ``__main__``
    here, but not in the worker, a spawned process that never runs the trainer's script)."""
    monkeypatch.setattr(_Config, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "_Config", _Config, raising=False)
    return _Config


def test_legacy_format_refuses_a_main_class_at_save(tmp_path: Path, main_class) -> None:
    with _engine(tmp_path, "megatron", "torch") as engine:
        with pytest.raises((TypeError, CheckpointError), match=r"cfg\.obj.*__main__"):
            engine.save(3, {"w": torch.ones(2), "cfg": {"obj": main_class(1)}})
        engine.save(4, {"w": torch.ones(2)}).committed_sync(60)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("iter_")) == ["iter_0000004"]
    assert L.read_tracker(tmp_path) == 4


def test_dcp_saves_a_main_class_the_trainer_pickles(tmp_path: Path, main_class) -> None:
    """dcp's objects are pickled in the trainer and never unpickled by the worker: allowed."""
    with _engine(tmp_path, "global_step", None) as engine:
        engine.save(3, {"w": torch.ones(2), "cfg": {"obj": main_class(1)}})
    target = {"w": torch.zeros(2), "cfg": {}}
    assert _engine(tmp_path, "global_step", None).load_latest(target) == 3
    assert target["cfg"]["obj"] == main_class(1)


def test_read_torch_dist_without_a_manifest_places_int_keyed_state(tmp_path: Path) -> None:
    """A torch_dist checkpoint read without our manifest's paths (an older asyncckpt's, or
    megatron's own): the optimizer's state still loads into a fresh optimizer."""
    from asyncckpt.formats import torch_dist as td

    model, optim = _model_and_optimizer(0, steps=1)
    with _engine(tmp_path, "megatron", "torch_dist") as engine:
        engine.save(1, {"model": model.state_dict(), "optim": optim.state_dict()})
    model2, optim2 = _model_and_optimizer(1, steps=0)
    target = {"model": model2.state_dict(), "optim": optim2.state_dict()}
    td.read_torch_dist(tmp_path / L.dir_name("megatron", 1), target)  # no paths given
    optim2.load_state_dict(target["optim"])
    assert_same(optim2.state_dict(), optim.state_dict())
    assert_same(model2.state_dict(), model.state_dict())


@pytest.mark.parametrize(("layout", "fmt"), FORMATS, ids=FORMAT_IDS)
def test_a_list_of_stateful_objects_is_restored_in_place(tmp_path: Path, layout, fmt) -> None:
    """Schedulers in a list: saved as their state dicts (not pickled objects, which would drag
    the optimizer along) and restored into the caller's objects, tensors or not."""

    def build(seed: int, steps: int) -> dict:
        model, optim = _model_and_optimizer(seed, 0)
        scheds = [
            torch.optim.lr_scheduler.StepLR(optim, 2),
            torch.optim.lr_scheduler.ExponentialLR(optim, 0.9),
        ]
        for _ in range(steps):
            model(torch.randn(5, 4)).square().sum().backward()
            optim.step()
            for s in scheds:
                s.step()
        return {"models": [model], "optim": optim, "scheds": scheds}

    state = build(0, steps=3)
    with _engine(tmp_path, layout, fmt) as engine:
        engine.save(1, state)
    target = build(1, steps=0)
    objects = [target["models"][0], *target["scheds"]]
    assert _engine(tmp_path, layout, fmt).load_latest(target) == 1
    got = [target["models"][0], *target["scheds"]]
    assert all(a is b for a, b in zip(got, objects, strict=True)), got
    assert_same(target["models"][0].state_dict(), state["models"][0].state_dict())
    for got, want in zip(target["scheds"], state["scheds"], strict=True):
        assert_same(got.state_dict(), want.state_dict())


# ------------------------------------------------------------------ issue 28 item 12: NaN, Inf


#: (float dtype, the int dtype of its width, exponent bits, mantissa bits)
_IEEE = [
    (torch.float32, torch.int32, 8, 23),
    (torch.float64, torch.int64, 11, 52),
]


def _special_bits(width_dtype: torch.dtype, e: int, m: int) -> torch.Tensor:
    """Signed zeros, infinities, quiet and signalling NaNs with payloads and either sign,
    subnormals and the largest finite, as raw bits of a float of ``e``/``m`` bits."""
    w = 1 + e + m
    sign, exp = 1 << (w - 1), ((1 << e) - 1) << m
    quiet = 1 << (m - 1)
    values = [
        0,
        sign,  # -0.0
        exp,  # +inf
        sign | exp,  # -inf
        exp | quiet,  # the canonical quiet NaN
        exp | quiet | 0x2345,  # a quiet NaN with a payload
        exp | 1,  # a signalling NaN
        exp | (quiet >> 1) | 0x15,  # a signalling NaN with a payload
        sign | exp | quiet | 7,  # a negative NaN with a payload
        sign | exp | 1,  # a negative signalling NaN
        1,  # the smallest subnormal
        quiet | 1,  # a subnormal
        exp - 1,  # the largest finite
    ]
    # Two's complement for the top bit: the int tensor of the float's width holds it.
    signed = [v - (1 << w) if v & sign else v for v in values]
    return torch.tensor(signed, dtype=width_dtype)


def special_state() -> dict:
    """Every bit pattern of the 8- and 16-bit floats (NaN payloads, -0.0, +/-inf included),
    and the special values of float32/64 and complex, small and (memcpy/located path) large."""
    state: dict = {}
    for dt in (torch.float16, torch.bfloat16):
        state[str(dt)] = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
        state[str(dt)] = state[str(dt)].view(dt)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        state[str(dt)] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt)
    for dt, ints, e, m in _IEEE:
        bits = _special_bits(ints, e, m)
        state[str(dt)] = bits.view(dt)
        state[f"{dt}.large"] = bits.repeat(200_000 // len(bits)).view(dt)  # over 1 MiB
    f32 = state["torch.float32"]
    state["torch.complex64"] = torch.cat([f32, f32.flip(0)]).view(torch.complex64)
    f64 = state["torch.float64"]
    state["torch.complex128"] = torch.cat([f64, f64.roll(1)]).view(torch.complex128)
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])


@pytest.mark.parametrize(("layout", "fmt"), FORMATS, ids=FORMAT_IDS)
def test_nan_inf_and_signed_zeros_round_trip_bit_for_bit(tmp_path: Path, layout, fmt) -> None:
    """What the README promises: a state's NaNs (payload and sign included), infinities and
    -0.0 load back with the very bits saved, in every float dtype and every format."""
    state = special_state()
    nans = sum(int(t.isnan().sum()) for t in state.values())
    assert nans > 0 and any(bool(t.isinf().any()) for t in state.values())
    saved = {k: _bits(t).clone() for k, t in state.items()}
    with _engine(tmp_path, layout, fmt) as engine:
        engine.save(1, state)
    target = {k: torch.zeros_like(t) for k, t in state.items()}
    assert _engine(tmp_path, layout, fmt).load_latest(target) == 1
    for k, want in saved.items():
        assert target[k].dtype == state[k].dtype, k
        assert torch.equal(_bits(target[k]), want), k
