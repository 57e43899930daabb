"""The CLI and pruning do not hurt the user: a policy's missing metric is said loudly, a prune
never leaves a root without a checkpoint that verifies, empty/missing/URL roots are clear
errors, progress bars only on a terminal, and ``--help`` does not import torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncckpt.cli import main
from asyncckpt.core import layout as L

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def make_ckpt(
    root: Path,
    step: int,
    metrics: dict[str, float] | None = None,
    payload: bytes = b"x" * 2048,
    layout: str = "global_step",
) -> Path:
    """test_prune's committed checkpoint (one shard, manifest with its real crc32), with a
    shard big enough for the progress tests."""
    from test_prune import make_ckpt as committed_ckpt

    return committed_ckpt(root, step, layout=layout, metrics=metrics, payload=payload)


def shard(root: Path, step: int) -> Path:
    return root / L.dir_name("global_step", step) / "__0_0.distcp"


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def steps(root: Path) -> list[int]:
    return [c.step for c in L.scan(root, "global_step")]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpts"
    for s in (10, 20, 30, 40):
        make_ckpt(r, s, metrics={"loss": 1.0 / s, "acc": s / 100})
    (r / L.TRACKER).write_text("40\n")
    return r


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- 6: --help and usage errors do not import torch -------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120
    )


def test_help_and_usage_errors_do_not_import_torch(tmp_path):
    code = (
        "import sys\n"
        "import asyncckpt.cli as c\n"
        "for argv in (['--help'], ['prune', '--help'], ['prune', 'x'], ['frob'], "
        f"['ls', {str(tmp_path / 'missing')!r}], ['verify', {str(tmp_path)!r}]):\n"
        "    try:\n"
        "        c.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad[:5]\n"
        "print('clean')\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "clean" in proc.stdout


def test_python_dash_m_help_does_not_import_torch():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "asyncckpt", "--help"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "prune" in proc.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()]
    assert "asyncckpt.cli" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_package_surface_is_unchanged_and_lazy():
    code = (
        "import sys\n"
        "import asyncckpt\n"
        "assert 'torch' not in sys.modules\n"
        "from asyncckpt import CheckpointEngine, SyncCheckpointEngine, PauseHooks, SaveHandle\n"
        "assert 'torch' in sys.modules\n"
        "import asyncckpt.engine as e\n"
        "assert CheckpointEngine is e.CheckpointEngine and PauseHooks is e.PauseHooks\n"
        "ns = {}\n"
        "exec('from asyncckpt import *', ns)\n"
        "missing = [n for n in asyncckpt.__all__ if n not in ns]\n"
        "assert not missing, missing\n"
        "assert set(asyncckpt.__all__) <= set(dir(asyncckpt))\n"
        "assert asyncckpt.__version__\n"
        "try:\n"
        "    asyncckpt.NoSuchThing\n"
        "except AttributeError as err:\n"
        "    assert 'NoSuchThing' in str(err)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
        "print('ok')\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout


# -- 4: URLs are not local paths (object stores go through storage/, see test_s3) --------------


@pytest.mark.parametrize(
    "url", ["s3://bucket/run", "gs://b/x", "az://c/d", "hf+s3://x", "file://tmp"]
)
def test_check_local_root_refuses_urls(url):
    from asyncckpt.core.paths import UnsupportedStorage, check_local_root
    from asyncckpt.errors import CheckpointError

    with pytest.raises(UnsupportedStorage, match="a URL is not a local path here") as info:
        check_local_root(url)
    assert url in str(info.value)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)


def test_check_local_root_accepts_paths(tmp_path):
    from asyncckpt.core.paths import check_local_root

    assert check_local_root(tmp_path) == tmp_path
    assert check_local_root(str(tmp_path / "a:b")) == tmp_path / "a:b"
    assert check_local_root("relative/dir") == Path("relative/dir")
    assert check_local_root("c:/odd") == Path("c:/odd")  # no '//': not a URL
    assert check_local_root(Path("c:/odd")) == Path("c:/odd")  # a drive letter, maybe


def test_a_path_made_from_a_url_is_refused_too():
    from asyncckpt import UnsupportedStorage, verify
    from asyncckpt.core.paths import check_local_root

    with pytest.raises(UnsupportedStorage, match="lost a '/'"):
        check_local_root(Path("s3://bucket/run"))  # Path() made it s3:/bucket/run
    with pytest.raises(UnsupportedStorage, match="gs://b"):
        verify("gs://b/run")


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["prune", "--keep-last", "1"]])
def test_cli_url_roots_no_backend_serves_are_a_clear_error(capsys, command):
    code, out, err = run(capsys, command[0], "nosuchfs://bucket/run", *command[1:])
    assert code == 1
    assert "nosuchfs://bucket/run" in err and "Protocol not known" in err
    assert "Traceback" not in err


# -- 1: a policy's metric missing from the checkpoints is said loudly ---------------------------


def ck(step: int, **metrics: float):
    from asyncckpt.retention import CheckpointInfo

    return CheckpointInfo(step, 1_700_000_000.0 + step, metrics)


def test_missing_metrics_is_a_pure_check():
    from asyncckpt.retention import KeepBest, KeepEvery, KeepLast, metric_warnings

    cps = [ck(1, loss=0.5), ck(2, loss=0.4), ck(3, loss=0.3, val_loss=0.9)]
    assert KeepBest(1, "val_loss").missing_metrics(cps) == {"val_loss"}
    assert KeepBest(1, "loss").missing_metrics(cps) == set()
    assert KeepBest(1, "val_loss", missing="keep").missing_metrics(cps) == set()  # opted in
    assert KeepLast(2).missing_metrics(cps) == set()
    policy = KeepLast(1) | KeepBest(1, "acc") | KeepBest(2, "val_loss", mode="max") | KeepEvery(2)
    assert policy.missing_metrics(cps) == {"acc", "val_loss"}
    assert policy.missing_metrics([]) == set()
    msgs = metric_warnings(policy, cps)
    assert sorted(msgs) == [
        "KeepBest(1, 'acc')/acc",
        "KeepBest(2, 'val_loss', mode='max')/val_loss",
    ]
    acc = msgs["KeepBest(1, 'acc')/acc"]
    assert "missing from 3 of 3" in acc and "'loss', 'val_loss'" in acc
    assert "step(s) 1, 2" in msgs["KeepBest(2, 'val_loss', mode='max')/val_loss"]


def test_plan_prune_carries_the_warning():
    from asyncckpt.retention import KeepBest, plan_prune

    cps = [ck(s, loss=1.0 / s) for s in (1, 2, 3)]
    plan = plan_prune(cps, KeepBest(1, "val_loss"), tracker_step=3)
    assert plan.delete == [1, 2]
    assert list(plan.warnings) == ["KeepBest(1, 'val_loss')/val_loss"]
    assert not plan_prune(cps, KeepBest(1, "loss"), tracker_step=3).warnings


def test_library_prune_warns_and_reports(root, caplog):
    from asyncckpt.retention import KeepBest, MissingMetricWarning
    from asyncckpt.storage.prune import prune

    with pytest.warns(MissingMetricWarning, match="'val_loss' is missing from 4 of 4") as rec:
        result = prune(root, "global_step", KeepBest(1, "val_loss"), dry_run=True)
    assert "metrics the checkpoints report: 'acc', 'loss'" in str(rec[0].message).lower()
    assert "val_loss" not in caplog.text  # one channel: the warning, not a log line too
    assert list(result.warnings) == ["KeepBest(1, 'val_loss')/val_loss"]
    import warnings as _w

    with _w.catch_warnings():
        _w.simplefilter("error")  # warn=False: the caller (the worker) reports them
        quiet = prune(root, "global_step", KeepBest(1, "val_loss"), dry_run=True, warn=False)
    assert quiet.warnings == result.warnings


def test_cli_keep_best_on_an_absent_metric_is_an_error(root, capsys):
    code, out, err = run(capsys, "prune", str(root), "--keep-best", "1", "--metric", "val_loss")
    assert code == 1
    assert "'val_loss'" in err and "metrics found: acc, loss" in err
    assert steps(root) == [10, 20, 30, 40]


def test_cli_keep_best_on_a_partly_missing_metric_warns(root, capsys):
    make_ckpt(root, 50, metrics={"loss": 9.0})  # no "acc"
    (root / L.TRACKER).write_text("50\n")
    code, out, err = run(capsys, "prune", str(root), "--keep-best", "1", "--metric", "acc")
    assert code == 0
    assert "warning: KeepBest(1, 'acc'): metric 'acc' is missing from 1 of 5" in err
    assert steps(root) == [10, 50]  # acc: 10 is the best (min); 50 is the newest


def test_engine_warns_in_the_trainer_once(tmp_path, caplog):
    import time
    import warnings as _w

    import torch

    from asyncckpt import KeepBest, SyncCheckpointEngine
    from asyncckpt.retention import MissingMetricWarning

    caplog.set_level("WARNING", logger="asyncckpt")
    with _w.catch_warnings(record=True) as caught:
        _w.simplefilter("always")
        with SyncCheckpointEngine(tmp_path, keep=KeepBest(1, "val_loss")) as engine:
            for s in (1, 2, 3):
                engine.save(s, {"w": torch.full((4,), float(s))}, metrics={"loss": 1.0 / s})
            engine.wait()
            deadline = time.monotonic() + 30
            while (r := engine.last_prune) is None or 3 not in r.kept:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    mine = [w for w in caught if issubclass(w.category, MissingMetricWarning)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "KeepBest(1, 'val_loss')" in str(mine[0].message)
    assert "Metrics the checkpoints report: 'loss'" in str(mine[0].message)
    # One channel (issue 32): the warning, not the same message logged as well.
    assert not [r for r in caplog.records if "'val_loss' is missing" in r.getMessage()]


# -- 2: pruning never leaves a root without a checkpoint that verifies -------------------------


class Recorder:
    """A progress.Progress that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def begin(self, description: str, total_bytes: int, total_checkpoints: int) -> None:
        self.calls.append(("begin", description, total_bytes, total_checkpoints))

    def advance(self, nbytes: int) -> None:
        self.calls.append(("advance", nbytes))

    def checkpoint_done(self, step: int, ok: bool) -> None:
        self.calls.append(("done", step, ok))

    def end(self) -> None:
        self.calls.append(("end",))

    def of(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


DAMAGE = {"flipped": flip_byte, "truncated": truncate, "deleted": Path.unlink}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_cli_prune_keeps_the_newest_that_verifies(root, capsys, damage):
    DAMAGE[damage](shard(root, 40))
    code, out, err = run(capsys, "prune", str(root), "--keep-last", "1", "--dry-run")
    assert code == 0 and "would delete: 10, 20" in out
    assert "newest that verifies" in out
    assert steps(root) == [10, 20, 30, 40]
    code, out, err = run(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 0, err
    assert steps(root) == [30, 40]
    assert "deleted: 10, 20" in out and "newest that verifies" in out
    assert "step 40 (kept: newest, tracker, KeepLast(1)) fails its manifest" in err
    assert "also keeping step 30, the newest that verifies" in err
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1 and "newest good: step 30" in out


def test_library_prune_result_and_json(root, capsys):
    from asyncckpt.retention import KeepLast
    from asyncckpt.storage.prune import prune

    flip_byte(shard(root, 40))
    flip_byte(shard(root, 30))
    rec = Recorder()
    with pytest.warns(UserWarning, match="step 40 .* fails its manifest"):
        result = prune(root, "global_step", KeepLast(1), progress=rec)
    assert result.deleted == [10, 30] and result.kept[20] == ["newest that verifies"]
    assert sorted(result.corrupt) == [30, 40] and "checksum mismatch" in result.corrupt[40][0]
    # newest first: 40 (kept, bad), then the candidates 30 (bad), 20 (good); 10 never read
    assert [c[1] for c in rec.of("begin")] == ["verifying step " + s for s in ("40", "30", "20")]
    assert rec.of("done") == [("done", 40, False), ("done", 30, False), ("done", 20, True)]
    assert steps(root) == [20, 40]  # the corrupt 30 was not kept by anything
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--json")
    data = json.loads(out)
    assert code == 0 and data["deleted"] == [] and data["kept"]["20"] == ["newest that verifies"]
    assert set(data["corrupt"]) == {"40"} and "step 40" in data["warnings"][0]


def test_nothing_verifies_refuses_unless_no_verify(root, capsys):
    from asyncckpt.retention import KeepLast
    from asyncckpt.storage.prune import PruneRefused, prune

    for s in (10, 20, 30, 40):
        truncate(shard(root, s))
    with pytest.raises(PruneRefused, match="no checkpoint .* verifies"):
        prune(root, "global_step", KeepLast(1))
    code, _, err = run(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 1 and "verifies against its manifest" in err and "--no-verify" in err
    assert steps(root) == [10, 20, 30, 40]
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--no-verify")
    assert code == 0 and steps(root) == [40]


def test_a_good_kept_checkpoint_is_read_once_and_trusted_ones_not_at_all(root):
    from asyncckpt.retention import KeepLast
    from asyncckpt.storage.prune import prune

    rec = Recorder()
    prune(root, "global_step", KeepLast(2), progress=rec, dry_run=True)
    assert rec.of("done") == [("done", 40, True)]  # newest verifies: nothing else read
    assert sum(n for _, n in rec.of("advance")) == 2048
    rec = Recorder()
    flip_byte(shard(root, 40))
    result = prune(root, "global_step", KeepLast(1), progress=rec, trusted=[40])
    assert rec.calls == [] and result.deleted == [10, 20, 30] and not result.corrupt


def test_the_engines_prune_trusts_the_checkpoint_it_just_committed(root, monkeypatch):
    """The worker's prune reads nothing back: the step it committed was checksummed as written
    (also when the tracker names a higher step: allow_older_steps, issue 28 item 4)."""
    from types import SimpleNamespace

    from asyncckpt.retention import KeepLast
    from asyncckpt.worker.loop import PruneRequest

    def no_read(*a, **k):
        raise AssertionError("the worker's prune read a checkpoint back")

    monkeypatch.setattr("asyncckpt.storage.manifest.check_dir", no_read)
    config = SimpleNamespace(layout="global_step")
    result = PruneRequest(policy=KeepLast(1)).run(root, config, 30)  # 40 is above: kept
    assert result.deleted == [10, 20] and steps(root) == [30, 40]
    result = PruneRequest(policy=KeepLast(1)).run(root, config, 40)
    assert result.deleted == [30] and steps(root) == [40]


def test_ls_marks_corrupt_checkpoints(root, capsys):
    truncate(shard(root, 20))
    flip_byte(shard(root, 30))
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    assert "status (sizes)" in out
    line = {ln.split()[1]: ln for ln in out.splitlines() if ln[:1] == "│" and ln.split()[1:2]}
    assert "CORRUPT" in line["20"] and "truncated" in out
    assert "CORRUPT" not in line["30"]  # a flipped byte needs --verify (reads every byte)
    assert " ok " in line["10"]
    code, out, _ = run(capsys, "ls", str(root), "--verify", "--json")
    data = {c["step"]: c for c in json.loads(out)["checkpoints"]}
    assert data[30]["status"].startswith("CORRUPT: ") and "checksum mismatch" in data[30]["status"]
    assert data[20]["status"].startswith("CORRUPT: ") and data[10]["status"] == "ok"
    assert json.loads(out)["checked"] == "checksums"


# -- 3: empty and missing roots -----------------------------------------------------------------


def test_verify_with_no_checkpoints_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / L.tmp_name("global_step", 5, "dead")).mkdir()  # a leftover is no checkpoint
    code, out, err = run(capsys, "verify", str(empty))
    assert code == 1 and f"no checkpoints found in {empty} (layout global_step)" in err
    assert "OK" not in out
    code, out, err = run(capsys, "verify", str(empty), "--json")
    assert code == 1 and "no checkpoints found" in err
    meg = tmp_path / "meg"
    make_ckpt(meg, 5, layout="megatron")
    code, _, err = run(capsys, "verify", str(meg), "--layout", "global_step")
    assert code == 1 and "it holds megatron checkpoints (pass --layout megatron)" in err


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["prune", "--keep-last", "1"]])
def test_missing_root_or_a_file_is_a_clear_error(tmp_path, capsys, command):
    missing = tmp_path / "nope"
    code, out, err = run(capsys, command[0], str(missing), *command[1:])
    assert code == 1 and f"error: no such directory: {missing}" in err
    assert "Traceback" not in err and not missing.exists()
    afile = tmp_path / "file"
    afile.write_text("x")
    code, out, err = run(capsys, command[0], str(afile), *command[1:])
    assert code == 1 and f"error: not a directory: {afile}" in err


# -- 5: progress ----------------------------------------------------------------------------------


def test_verify_reports_progress_per_checkpoint_and_byte(root):
    from asyncckpt import verify

    truncate(shard(root, 20))
    rec = Recorder()
    report = verify(root, progress=rec)
    assert [c.ok for c in report.checkpoints] == [True, False, True, True]
    assert rec.calls[0] == ("begin", f"verifying {root}", 4 * 2048, 4)
    assert rec.of("done") == [("done", 10, True), ("done", 20, False), ("done", 30, True)] + [
        ("done", 40, True)
    ]
    assert sum(n for _, n in rec.of("advance")) == 4 * 2048  # the truncated one made up
    assert rec.calls[-1] == ("end",)
    assert verify(root).ok is False  # no progress: same answer, nothing reported


def test_rich_progress_shows_only_on_a_terminal(root):
    import io

    from rich.console import Console

    from asyncckpt import verify
    from asyncckpt.core.progress import RichProgress

    for terminal in (False, True):
        buf = io.StringIO()
        with RichProgress(Console(file=buf, force_terminal=terminal, width=100)) as bar:
            verify(root, progress=bar)
        if terminal:
            assert "\x1b[" in buf.getvalue()
        else:
            assert buf.getvalue() == ""


def test_cli_in_a_pipe_has_no_escape_codes(root):
    flip_byte(shard(root, 40))
    for argv in (["verify", str(root)], ["prune", str(root), "--keep-last", "1"]):
        proc = subprocess.run(
            [sys.executable, "-m", "asyncckpt", *argv],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
        )
        assert proc.returncode in (0, 1), proc.stderr
        assert "\x1b" not in proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
    assert steps(root) == [30, 40]
