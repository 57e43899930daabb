"""Loading (issue 11): a target that does not fit is refused before anything is written, with
``strict=`` as in ``load_state_dict``; a checkpoint pruned while a reader loads is skipped
quietly; load errors are asyncckpt's own ``Exception``s; path mistakes are loud."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from asyncckpt import (
    CheckpointEngine,
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    NotACheckpointRoot,
    StateMismatch,
    SyncCheckpointEngine,
)
from asyncckpt.core import layout as L

pytestmark = pytest.mark.anyio

STEPS = (1, 2)


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
        "optim": {"m": torch.randn(4, 3, generator=g, dtype=torch.float64)},
        "step": step,
    }


def blank() -> dict:
    s = state_at(0)
    for group in ("model", "optim"):
        for t in s[group].values():
            t.fill_(7)
    s["step"] = -1
    return s


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    out = {}
    for group in ("model", "optim"):
        for k, t in state[group].items():
            out[f"{group}.{k}"] = t.clone()
    return out


def assert_unchanged(state: dict, before: dict[str, torch.Tensor]) -> None:
    after = tensors_of(state)
    assert after.keys() == before.keys()
    for k, t in before.items():
        assert after[k].shape == t.shape and after[k].dtype == t.dtype, k
        assert torch.equal(after[k], t), k


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("template") / "ckpts"
    with SyncCheckpointEngine(root) as engine:
        for s in STEPS:
            engine.save(s, state_at(s)).committed_sync()
    return root


@pytest.fixture
def root(template, tmp_path) -> Path:
    r = tmp_path / "ckpts"
    shutil.copytree(template, r)
    return r


@pytest.fixture
def quiet(caplog):
    """Collects warnings and asyncckpt's log records of WARNING and above."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            yield record, caplog


def assert_nothing_said(record, caplog) -> None:
    assert not [str(w.message) for w in record], [str(w.message) for w in record]
    ours = [r for r in caplog.records if r.name.startswith("asyncckpt")]
    assert not [r for r in ours if r.levelno >= logging.WARNING], caplog.text


# ------------------------------------------------------------------ item 4: the pre-check


@pytest.mark.parametrize(
    "change, key, want, found",
    [
        (lambda s: s["model"].update(w=torch.full((5, 3), 7.0)), "model.w", "(5, 3)", "(4, 3)"),
        (
            lambda s: s["optim"].update(m=torch.full((4, 3), 7.0)),  # float32 vs float64
            "optim.m",
            "float32",
            "float64",
        ),
    ],
    ids=["shape", "dtype"],
)
def test_mismatch_raises_changes_nothing_and_does_not_fall_back(
    root, quiet, change, key, want, found
):
    target = blank()
    change(target)
    before = tensors_of(target)
    with pytest.raises(StateMismatch) as info:
        SyncCheckpointEngine(root).load_latest(target)
    msg = str(info.value)
    assert key in msg and want in msg and found in msg, msg
    assert isinstance(info.value, CheckpointError)
    assert_unchanged(target, before)
    assert target["step"] == -1
    assert_nothing_said(*quiet)  # not "unusable", no fallback to step 1


def test_mismatch_in_a_module_changes_no_parameter(tmp_path, quiet):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, {"model": model}).committed_sync()
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5))  # wider head
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(StateMismatch, match=r"model\.1\.weight.*\(5, 4\).*\(2, 4\)"):
        SyncCheckpointEngine(tmp_path).load_latest({"model": other})
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), k  # model.0 was not loaded either
    assert_nothing_said(*quiet)


def test_missing_key_strict_raises_lenient_loads_the_rest(root):
    target = blank()
    target["model"]["extra"] = torch.full((2,), 7.0)
    before = tensors_of(target)
    engine = SyncCheckpointEngine(root)
    with pytest.raises(StateMismatch, match=r"missing.*model\.extra"):
        engine.load_latest(target)
    assert_unchanged(target, before)
    assert engine.load_latest(target, strict=False) == 2
    want = state_at(2)
    assert torch.equal(target["model"]["w"], want["model"]["w"])
    assert torch.equal(target["optim"]["m"], want["optim"]["m"])
    assert torch.equal(target["model"]["extra"], torch.full((2,), 7.0))  # kept
    assert target["step"] == 2
    report = engine.last_load_report
    assert report.missing == ["model.extra"] and report.unexpected == [] and report.step == 2


def test_unexpected_key_strict_raises_lenient_skips_it(root):
    target = blank()
    del target["model"]["b"]
    before = tensors_of(target)
    engine = SyncCheckpointEngine(root)
    with pytest.raises(StateMismatch, match=r"unexpected.*model\.b"):
        engine.load_latest(target)
    assert_unchanged(target, before)
    assert engine.load(target, step=1, strict=False) == 1
    assert torch.equal(target["model"]["w"], state_at(1)["model"]["w"])
    assert "b" not in target["model"]  # not added
    assert engine.last_load_report.unexpected == ["model.b"]


def test_lenient_load_into_modules(tmp_path):
    """strict=False with Stateful objects: the module gets a complete state dict."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, {"model": model}).committed_sync()
    bigger = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)
    )
    extra = bigger[2].weight.detach().clone()
    engine = SyncCheckpointEngine(tmp_path)
    with pytest.raises(StateMismatch, match=r"model\.2\.weight"):
        engine.load_latest({"model": bigger})
    assert engine.load_latest({"model": bigger}, strict=False) == 1
    assert torch.equal(bigger[0].weight, model[0].weight)
    assert torch.equal(bigger[1].bias, model[1].bias)
    assert torch.equal(bigger[2].weight, extra)
    assert sorted(engine.last_load_report.missing) == ["model.2.bias", "model.2.weight"]
    smaller = torch.nn.Sequential(torch.nn.Linear(3, 4))
    assert engine.load_latest({"model": smaller}, strict=False) == 1
    assert torch.equal(smaller[0].weight, model[0].weight)
    assert sorted(engine.last_load_report.unexpected) == ["model.1.bias", "model.1.weight"]


def test_a_fresh_optimizer_loads_a_stepped_one_strictly(tmp_path, quiet):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, {"model": model, "optim": opt}).committed_sync()
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    engine = SyncCheckpointEngine(tmp_path)
    assert engine.load_latest({"model": model2, "optim": opt2}) == 1
    assert torch.equal(model2.weight, model.weight)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for name in s1[k]:
            assert torch.equal(s1[k][name], s2[k][name]), (k, name)
    assert engine.last_load_report.exact
    assert_nothing_said(*quiet)


@pytest.mark.parametrize(
    "fmt, layout", [("torch_dist", "megatron"), ("megatron_legacy", "megatron")]
)
def test_megatron_formats_check_before_writing(tmp_path, quiet, fmt, layout):
    with SyncCheckpointEngine(tmp_path, layout=layout, format=fmt) as engine:
        for s in STEPS:
            engine.save(s, state_at(s)).committed_sync()
    engine = SyncCheckpointEngine(tmp_path, layout=layout, format=fmt)
    target = blank()
    target["model"]["w"] = torch.full((5, 3), 7.0)
    before = tensors_of(target)
    with pytest.raises(StateMismatch, match=r"model\.w.*\(5, 3\).*\(4, 3\)"):
        engine.load_latest(target)
    assert_unchanged(target, before)
    assert_nothing_said(*quiet)
    target["model"]["extra"] = torch.zeros(2)
    target["model"]["w"] = torch.zeros(4, 3)
    with pytest.raises(StateMismatch, match=r"missing.*model\.extra"):
        engine.load_latest(target)
    assert engine.load_latest(target, strict=False) == 2
    assert torch.equal(target["model"]["w"], state_at(2)["model"]["w"])
    assert torch.equal(target["model"]["extra"], torch.zeros(2))
    assert engine.last_load_report.missing == ["model.extra"]


# ------------------------------------------------------------------ item 8: pruned mid-load


def _trash(path: Path) -> None:
    os.rename(path, path.parent / L.trash_name(path.name, "test"))


def test_a_checkpoint_pruned_after_the_scan_is_skipped_quietly(root, monkeypatch, quiet):
    real_scan = L.scan

    def scan_then_prune(*args, **kwargs):
        found = real_scan(*args, **kwargs)
        if found[-1].path.exists():
            _trash(found[-1].path)  # the pruner wins the race right after the first scan
        return found

    monkeypatch.setattr(L, "scan", scan_then_prune)
    target = blank()
    assert SyncCheckpointEngine(root).load_latest(target) == 1
    assert torch.equal(target["model"]["w"], state_at(1)["model"]["w"])
    assert_nothing_said(*quiet)


@pytest.mark.parametrize("when", ["before_verify", "before_read"])
def test_a_checkpoint_pruned_during_the_load_is_skipped_quietly(root, monkeypatch, quiet, when):
    from asyncckpt.formats import staged
    from asyncckpt.trainer import restore as E  # where the load verifies

    newest = root / L.dir_name("global_step", 2)
    if when == "before_verify":
        real = E.check_files

        def hook(directory, files, **kw):
            if Path(directory) == newest and newest.exists():
                _trash(newest)
            return real(directory, files, **kw)

        monkeypatch.setattr(E, "check_files", hook)
    else:
        real_load = staged.load_into

        def hook(fmt, state, directory, *args, **kwargs):
            if Path(directory) == newest:
                _trash(newest)
            return real_load(fmt, state, directory, *args, **kwargs)

        monkeypatch.setattr(staged, "load_into", hook)
    target = blank()
    assert SyncCheckpointEngine(root).load_latest(target) == 1
    assert torch.equal(target["optim"]["m"], state_at(1)["optim"]["m"])
    assert target["step"] == 1
    assert_nothing_said(*quiet)


# ------------------------------------------------------------------ item 10: own errors


def test_a_failed_load_is_an_exception_of_ours(root):
    shard = max((root / "global_step_2").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    engine = SyncCheckpointEngine(root, verify_on_load=False)
    with pytest.raises(Exception) as info:  # noqa: B017 - the point: `except Exception` works
        engine.load(blank(), step=2)
    assert isinstance(info.value, CorruptCheckpoint)
    assert info.value.__cause__ is not None and "global_step_2" in str(info.value)


async def test_a_failed_load_is_an_exception_of_ours_async(root):
    (root / "global_step_2" / ".metadata").write_bytes(b"garbage")
    engine = CheckpointEngine(root, verify_on_load=False)
    with pytest.raises(CheckpointError):
        await engine.load(blank(), step=2)


# ------------------------------------------------------------------ path mistakes


def test_a_missing_root_is_a_fresh_start_said_in_one_log_warning(tmp_path, caplog, recwarn):
    missing = tmp_path / "nope" / "ckpts"
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        assert SyncCheckpointEngine(missing).load_latest(blank()) is None
    (said,) = [r for r in caplog.records if "does not exist" in r.getMessage()]
    assert said.levelno == logging.WARNING and str(missing.absolute()) in said.getMessage()
    assert not [w for w in recwarn if "does not exist" in str(w.message)]


@pytest.mark.parametrize("layout", ["global_step", "megatron"])
def test_a_checkpoint_directory_is_not_a_root(root, layout):
    directory = root / "global_step_2"
    with pytest.raises(NotACheckpointRoot, match=r"global_step_2 is a checkpoint directory"):
        SyncCheckpointEngine(directory, layout=layout).load_latest(blank())
    # also when its name does not give it away
    renamed = root / "renamed"
    os.rename(directory, renamed)
    with pytest.raises(NotACheckpointRoot, match=r"load\(state, path="):
        SyncCheckpointEngine(renamed).load_latest(blank())


def test_a_root_of_the_other_layout_is_refused(root):
    with pytest.raises(NotACheckpointRoot, match=r"global_step_2.*layout"):
        SyncCheckpointEngine(root, layout="megatron").load_latest(blank())


def test_a_file_is_not_a_root(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotACheckpointRoot, match="not a directory"):
        SyncCheckpointEngine(f).load_latest(blank())


def test_an_optimizer_that_refuses_the_state_is_a_mismatch(tmp_path):
    """What only ``load_state_dict`` notices (param groups of another size) is the caller's
    mistake too: StateMismatch, not corruption, and no fallback."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, {"optim": opt}).committed_sync()
    other = torch.nn.Linear(3, 2)
    two_groups = torch.optim.SGD([{"params": [other.weight]}, {"params": [other.bias]}], lr=0.1)
    with pytest.raises(StateMismatch, match="global_step_1"):
        SyncCheckpointEngine(tmp_path).load_latest({"optim": two_groups})


def test_progress_bar_on_a_terminal(root, monkeypatch):
    import sys

    from asyncckpt.formats import loadcheck

    shown = []
    real_enter = loadcheck.Progress.__enter__

    def enter(self):
        out = real_enter(self)
        shown.append(self._bar is not None)
        return out

    monkeypatch.setattr(loadcheck, "PROGRESS_MIN_BYTES", 1)
    monkeypatch.setattr(loadcheck.Progress, "__enter__", enter)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    target = blank()
    assert SyncCheckpointEngine(root).load_latest(target) == 2
    assert shown == [True]
    monkeypatch.setattr(loadcheck, "PROGRESS_MIN_BYTES", 1 << 40)
    assert SyncCheckpointEngine(root).load_latest(target) == 2
    assert shown == [True, False]


def test_loading_while_another_process_prunes(root, quiet):
    """A real race: a thread commits copies of a checkpoint and prunes the older ones (rename
    to trash, then delete, as the pruner does) while this thread loads in a loop."""
    import threading
    import time

    from asyncckpt.storage.prune import trash_and_delete

    source = root / "global_step_2"
    stop = threading.Event()
    errors = []

    def commit_and_prune() -> None:
        step = 3
        try:
            while not stop.is_set():
                tmp = root / L.tmp_name("global_step", step, "t")
                shutil.copytree(source, tmp)
                os.rename(tmp, root / L.dir_name("global_step", step))
                for old in L.scan(root, "global_step")[:-1]:
                    if old.step > 2:
                        trash_and_delete(root, old.path)
                step += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    pruner = threading.Thread(target=commit_and_prune)
    pruner.start()
    loads = 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            target = blank()
            assert SyncCheckpointEngine(root).load_latest(target) >= 2
            assert torch.equal(target["model"]["w"], state_at(2)["model"]["w"])
            loads += 1
    finally:
        stop.set()
        pruner.join()
    assert not errors and loads > 5
    assert_nothing_said(*quiet)


@pytest.mark.filterwarnings("ignore:.*has no manifest")
def test_torch_dist_restores_a_fresh_optimizers_state(tmp_path):
    """A fresh optimizer (empty state) takes a stepped one's moments from torch_dist, also
    from a checkpoint without asyncckpt's manifest (the paths are guessed from the target)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    with SyncCheckpointEngine(tmp_path, layout="megatron") as engine:
        engine.save(1, {"model": model, "optim": opt})
    (tmp_path / L.dir_name("megatron", 1) / L.MANIFEST).unlink()  # megatron's files only
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(model2.parameters())
    engine = SyncCheckpointEngine(tmp_path, layout="megatron")
    with pytest.warns(UserWarning, match="no manifest"):
        assert engine.load_latest({"model": model2, "optim": opt2}) == 1
    assert torch.equal(model2.weight, model.weight)
    for p in (0, 1):
        assert torch.equal(
            opt2.state_dict()["state"][p]["exp_avg"],
            opt.state[opt.param_groups[0]["params"][p]]["exp_avg"],
        )


# ------------------------------------------------------------------ issue 28 item 8: not found


def test_a_missing_step_is_an_error_of_ours(root):
    """A step never committed, and a directory that is not there, are asyncckpt errors (that
    are also FileNotFoundError, for callers that caught that before)."""
    from asyncckpt.formats.reading import read_checkpoint

    target, before = blank(), tensors_of(blank())
    engine = SyncCheckpointEngine(root)
    with pytest.raises(CheckpointNotFound, match="step 99"):
        engine.load(target, step=99)
    with pytest.raises(CheckpointNotFound, match="no checkpoint directory"):
        engine.load(target, path=root / "global_step_99")
    with pytest.raises(CheckpointNotFound):
        read_checkpoint(root / "global_step_99")
    assert issubclass(CheckpointNotFound, CheckpointError)
    assert issubclass(CheckpointNotFound, FileNotFoundError)
    assert_unchanged(target, before)


@pytest.mark.parametrize(
    "when", ["after_listing", "before_manifest", "before_check", "before_verify", "before_read"]
)
def test_a_step_pruned_between_listing_and_reading_is_an_error_of_ours(root, monkeypatch, when):
    """load(step=N) of a step another process prunes between the caller's listing and the
    read: the same not-found error (``Vanished`` once the read began) wherever the race
    falls, never a bare FileNotFoundError nor a report of corruption."""
    from asyncckpt.formats import loadcheck, staged
    from asyncckpt.trainer import restore as E

    engine = SyncCheckpointEngine(root)
    assert 2 in [c.step for c in engine.list_checkpoints()]  # the caller's listing
    newest = root / L.dir_name("global_step", 2)

    def prune_then(real):
        def hook(*args, **kwargs):
            if newest.exists():
                _trash(newest)
            return real(*args, **kwargs)

        return hook

    if when == "after_listing":
        _trash(newest)
    elif when == "before_manifest":
        monkeypatch.setattr(E, "read_manifest", prune_then(E.read_manifest))
    elif when == "before_check":
        monkeypatch.setattr(loadcheck, "check", prune_then(loadcheck.check))
    elif when == "before_verify":
        monkeypatch.setattr(E, "check_files", prune_then(E.check_files))
    else:
        monkeypatch.setattr(staged, "load_into", prune_then(staged.load_into))
    target, before = blank(), tensors_of(blank())
    with pytest.raises(CheckpointNotFound, match="global_step_2|step 2"):
        engine.load(target, step=2)
    assert_unchanged(target, before)


# ------------------------------------------------------------------ issue 28 item 7: view targets


def views_state(seed: int) -> dict:
    """Tensors whose logical values differ from their memory: conjugate and negative views
    (``torch._neg_view`` is what ``x.conj().imag`` gives a float tensor, made contiguous),
    small (one template record, one foreach copy) and large (located record, memcpy)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for size, n in (("small", 5), ("large", 300_000)):

        def c(dtype=torch.complex64, n=n):
            return torch.randn(n, dtype=dtype, generator=g)

        out[size] = {
            "conj": c().conj(),
            "neg": torch._neg_view(torch.randn(n, generator=g)),
            "conj_imag": c(torch.complex128).conj().imag,
            "neg_conj": torch._neg_view(c().conj()),
        }
    return out


def logical(state: dict) -> dict:
    return {
        size: {k: t.resolve_conj().resolve_neg().clone() for k, t in group.items()}
        for size, group in state.items()
    }


@pytest.mark.parametrize(
    "layout, fmt",
    [("global_step", "dcp"), ("megatron", "torch_dist"), ("megatron", "megatron_legacy")],
)
def test_conjugate_and_negative_views_save_and_load_their_logical_values(tmp_path, layout, fmt):
    """Saved: a view's logical values (what ``resolve_conj().resolve_neg()`` gives). Loaded
    into a view (the very state that was saved, as a resume does): the view reads back those
    values, not a "corrupt" checkpoint and a fall back to nothing."""
    state = views_state(1)
    want = logical(state)
    with SyncCheckpointEngine(tmp_path, layout=layout, format=fmt) as engine:
        engine.save(1, state).committed_sync()
    # Into plain tensors: what is on disk is the logical values.
    plain = {size: {k: torch.zeros_like(t) for k, t in g.items()} for size, g in want.items()}
    engine = SyncCheckpointEngine(tmp_path, layout=layout, format=fmt)
    assert engine.load_latest(plain) == 1
    for size, group in want.items():
        for k, t in group.items():
            assert torch.equal(plain[size][k], t), (size, k)
    # Into the views themselves, after the training moved on.
    for group in state.values():
        for t in group.values():
            t.zero_()
    assert engine.load_latest(state) == 1
    for size, group in want.items():
        for k, t in group.items():
            view = state[size][k]
            assert view.is_conj() or view.is_neg(), (size, k)  # still the caller's view
            assert torch.equal(view.resolve_conj().resolve_neg(), t), (size, k)
    if fmt == "dcp":  # and plain DCP reads the same values
        import torch.distributed.checkpoint as dcp

        again = {s: {k: torch.zeros_like(t) for k, t in g.items()} for s, g in want.items()}
        dcp.load(again, checkpoint_id=str(tmp_path / "global_step_1"))
        for size, group in want.items():
            for k, t in group.items():
                assert torch.equal(again[size][k], t), (size, k)


@pytest.mark.parametrize("strict", [True, False])
def test_a_self_overlapping_target_is_a_mismatch_before_anything_is_read(root, quiet, strict):
    """An expanded tensor cannot hold distinct values: the caller's StateMismatch naming the
    key, with nothing changed and no checkpoint called unusable (verify says they are fine)."""
    target = blank()
    target["model"]["w"] = torch.full((1, 3), 7.0).expand(4, 3)
    target["optim"]["m"] = torch.full((4, 1), 7.0, dtype=torch.float64).expand(4, 3)
    before = tensors_of(target)
    engine = SyncCheckpointEngine(root)
    with pytest.raises(StateMismatch, match=r"model\.w.*optim\.m|optim\.m.*model\.w") as info:
        engine.load_latest(target, strict=strict)
    assert "overlap" in str(info.value)
    assert not isinstance(info.value, CorruptCheckpoint)
    assert_unchanged(target, before)
    assert target["step"] == -1
    with pytest.raises(StateMismatch, match=r"model\.w"):
        engine.load(target, step=1, strict=strict)
    assert_unchanged(target, before)
    assert_nothing_said(*quiet)
    # A tensor of its own loads.
    target["model"]["w"] = target["model"]["w"].clone()
    target["optim"]["m"] = target["optim"]["m"].clone()
    assert engine.load_latest(target, strict=strict) == 2
    assert torch.equal(target["model"]["w"], state_at(2)["model"]["w"])


_BASE = torch.arange(12.0)


@pytest.mark.parametrize(
    "t, overlaps",
    [
        (torch.zeros(1).expand(4), True),
        (torch.zeros(3, 1).expand(3, 4), True),
        (_BASE.as_strided((3, 3), (1, 1)), True),  # sliding windows share elements
        (_BASE.as_strided((3, 2), (2, 3)), False),  # interleaved strides, distinct offsets
        (_BASE.view(3, 4).t(), False),
        (_BASE[::2], False),
        (torch.zeros(1, 3).expand(1, 3), False),  # a stride 0 over one element only
        (torch.zeros(0, 3).expand(0, 3), False),
    ],
)
def test_self_overlap_is_found_exactly(t, overlaps):
    from asyncckpt.formats.loadcheck import self_overlapping

    assert self_overlapping(t) is overlaps
