"""Per-save figures: recorded in each manifest, shown by ``python -m asyncckpt stats`` (table,
JSON, PNG plot), and logged to TensorBoard by ``asyncckpt.tensorboard.TensorBoardLogger``."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

from asyncckpt.cli import main
from asyncckpt.core import layout as L
from asyncckpt.stats import read_stats, summarize
from asyncckpt.storage.manifest import read_manifest, verify

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
STEPS = (10, 20, 30)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def engine_root(tmp_path_factory) -> tuple[Path, dict]:
    """A root written by a real engine (3 saves), with the SaveStats each commit reported."""
    import torch

    from asyncckpt import SyncCheckpointEngine

    root = tmp_path_factory.mktemp("stats") / "ckpts"
    reported: dict = {}
    threads: list[str] = []

    def on_commit(s):
        reported.setdefault(s.step, s)
        threads.append(threading.current_thread().name)
        if s.step == STEPS[1]:
            raise RuntimeError("dashboard bug")  # logged; the save stays committed

    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    logging.getLogger("asyncckpt").addHandler(handler)
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    try:
        with SyncCheckpointEngine(root, on_commit=on_commit) as eng:
            for step in STEPS:
                state["w"].add_(1.0)
                assert eng.save(step, state).committed_sync(60).step == step
    finally:
        logging.getLogger("asyncckpt").removeHandler(handler)
    # on_commit runs on the engine's reader thread, as documented; its exception is logged.
    assert threads == ["asyncckpt-reader"] * 3
    (failed,) = [r for r in logged if "on_commit callback raised" in r.getMessage()]
    assert failed.exc_info and "dashboard bug" in str(failed.exc_info[1])
    # A checkpoint with the new manifest fields loads as before.
    target = {"w": torch.zeros(256, 256), "b": torch.zeros(256)}
    assert SyncCheckpointEngine(root).load_latest(target) == STEPS[-1]
    assert torch.equal(target["w"], state["w"])
    return root, reported


# -- the figures in the manifest ------------------------------------------------------------


def test_manifest_records_the_figures_on_commit_reported(engine_root):
    root, reported = engine_root
    assert verify(root).ok  # the new fields leave verify unmoved
    for step in STEPS:
        m = read_manifest(root / L.dir_name("global_step", step))
        s = reported[step]
        fig = m["stats"]
        # Trainer-side figures travelled with the job, unchanged.
        assert fig["stage_seconds"] == s.stage_seconds > 0
        assert fig["wait_seconds"] == s.wait_seconds
        assert fig["alloc_seconds"] == s.alloc_seconds
        assert fig["staged_bytes"] == s.staged_bytes == 256 * 257 * 4
        assert fig["blocked_seconds"] == pytest.approx(s.blocked_seconds)
        # Worker-side ones are the same figures the commit reported.
        assert fig["write_seconds"] == s.write_seconds > 0
        assert fig["paused_seconds"] == s.paused_seconds == 0.0
        assert m["bytes"] == s.bytes == sum(f["size"] for f in m["files"].values())
        assert m["committed_at"] == s.committed_at
        assert fig["throughput_bytes_per_s"] == pytest.approx(s.throughput_bytes_per_s)
        # What of the commit is known when the manifest is built: its checksum pass.
        assert 0 <= fig["manifest_seconds"] <= s.commit_seconds
    # Only the first save of a layout allocates the arenas.
    assert reported[STEPS[0]].alloc_seconds > 0 and reported[STEPS[1]].alloc_seconds == 0


def test_read_stats_and_summary(engine_root):
    root, reported = engine_root
    records = read_stats(root)
    assert [r.step for r in records] == list(STEPS)
    for r in records:
        m = read_manifest(r.path)
        assert r.bytes == m["bytes"] == sum(f["size"] for f in m["files"].values())
        assert r.blocked_seconds >= r.stage_seconds > 0
        assert r.write_seconds == reported[r.step].write_seconds
        assert r.throughput_bytes_per_s == pytest.approx(r.bytes / r.write_seconds)
        assert r.committed_at == reported[r.step].committed_at
    summary = summarize(records)
    stalls = sorted(r.blocked_seconds for r in records)
    assert summary["checkpoints"] == 3 and summary["with_figures"] == 3
    assert summary["median_stall_seconds"] == stalls[1]
    assert stalls[1] <= summary["p90_stall_seconds"] <= stalls[2]
    assert summary["total_bytes"] == sum(r.bytes for r in records)
    assert summary["median_throughput_bytes_per_s"] == pytest.approx(
        sorted(r.throughput_bytes_per_s for r in records)[1]
    )


def test_stats_cli_table_and_json(engine_root, capsys):
    root, reported = engine_root
    code, out, err = run(capsys, "stats", str(root))
    assert code == 0, err
    for col in ("step", "committed", "size", "stall", "write", "throughput", "paused"):
        assert col in out
    for step in STEPS:
        assert str(step) in out
    assert "median stall" in out and "p90" in out and "total" in out
    code, out, err = run(capsys, "stats", str(root), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["layout"] == "global_step"
    by_step = {c["step"]: c for c in data["checkpoints"]}
    assert sorted(by_step) == list(STEPS)
    for step, c in by_step.items():
        assert c["bytes"] == reported[step].bytes
        assert c["blocked_seconds"] >= c["stage_seconds"] > 0
        assert c["write_seconds"] == reported[step].write_seconds
    assert data["summary"]["total_bytes"] == sum(s.bytes for s in reported.values())


def test_stats_cli_plot_writes_a_png(engine_root, tmp_path, capsys):
    root, _ = engine_root
    png = tmp_path / "figs" / "stats.png"
    png.parent.mkdir()
    code, out, err = run(capsys, "stats", str(root), "--plot", str(png))
    assert code == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert str(png) in out


def test_plot_without_matplotlib_is_a_clear_error(engine_root, tmp_path, capsys, monkeypatch):
    root, _ = engine_root
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, err = run(capsys, "stats", str(root), "--plot", str(tmp_path / "x.png"))
    assert code == 1
    assert "matplotlib" in err and "asyncckpt[bench]" in err
    assert not (tmp_path / "x.png").exists()


# -- manifests written before the figures ------------------------------------------------------


def old_ckpt(root: Path, step: int, layout: str = "global_step") -> Path:
    """A checkpoint as an older asyncckpt left it: a manifest with no ``stats``."""
    d = root / L.dir_name(layout, step)
    d.mkdir(parents=True)
    payload = b"y" * 3000
    (d / "__0_0.distcp").write_bytes(payload)
    manifest = {
        "step": step,
        "committed_at": 1_700_000_000.0 + step,
        "metrics": {},
        "bytes": len(payload),
        "files": {"__0_0.distcp": {"size": len(payload), "crc32": zlib.crc32(payload)}},
        "run_id": "old",
    }
    (d / L.MANIFEST).write_text(json.dumps(manifest))
    return d


def test_old_manifests_show_dashes(tmp_path, capsys):
    root = tmp_path / "old"
    for step in (1, 2):
        old_ckpt(root, step)
    (root / L.TRACKER).write_text("2")
    records = read_stats(root)
    assert [r.step for r in records] == [1, 2]
    assert all(r.bytes == 3000 and r.blocked_seconds is None for r in records)
    assert all(r.write_seconds is None and r.throughput_bytes_per_s is None for r in records)
    summary = summarize(records)
    assert summary["with_figures"] == 0 and summary["median_stall_seconds"] is None
    assert summary["total_bytes"] == 6000
    code, out, err = run(capsys, "stats", str(root))
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.strip().startswith(("│ 1 ", "│ 2 "))]
    assert len(rows) == 2 and all("-" in r for r in rows), out
    assert "2.9 KiB" in out
    code, out, err = run(capsys, "stats", str(root), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [c["blocked_seconds"] for c in data["checkpoints"]] == [None, None]
    assert data["summary"]["median_stall_seconds"] is None
    # Nothing to plot is said, not drawn as an empty figure.
    code, _, err = run(capsys, "stats", str(root), "--plot", str(tmp_path / "p.png"))
    assert code == 1 and "no checkpoint" in err and "figures" in err
    # ls and verify read them as before.
    assert run(capsys, "ls", str(root))[0] == 0
    assert run(capsys, "verify", str(root))[0] == 0


def test_engine_checkpoint_without_figures_loads(engine_root, tmp_path, capsys):
    """An engine-written checkpoint whose manifest predates the figures: load, verify, stats."""
    import shutil

    import torch

    from asyncckpt import SyncCheckpointEngine

    src, reported = engine_root
    root = tmp_path / "old-engine"
    name = L.dir_name("global_step", STEPS[-1])
    shutil.copytree(src / name, root / name)
    m = json.loads((root / name / L.MANIFEST).read_text())
    del m["stats"]
    (root / name / L.MANIFEST).write_text(json.dumps(m))
    target = {"w": torch.zeros(256, 256), "b": torch.zeros(256)}
    assert SyncCheckpointEngine(root).load(target, step=STEPS[-1]) == STEPS[-1]
    assert target["w"].abs().sum() > 0
    assert verify(root).ok
    (r,) = read_stats(root)
    assert r.bytes == reported[STEPS[-1]].bytes and not r.has_figures
    assert run(capsys, "stats", str(root))[0] == 0


def test_mixed_and_unreadable_manifests(engine_root, tmp_path, capsys):
    """Old next to new, a junk figure and an unreadable manifest: each shown, none fatal."""
    import shutil

    src, _ = engine_root
    root = tmp_path / "mixed"
    old_ckpt(root, 5)
    shutil.copytree(src / L.dir_name("global_step", 10), root / L.dir_name("global_step", 10))
    junk = old_ckpt(root, 15)
    m = json.loads((junk / L.MANIFEST).read_text())
    m["stats"] = {"write_seconds": "fast", "stage_seconds": None, "wait_seconds": True}
    (junk / L.MANIFEST).write_text(json.dumps(m))
    broken = old_ckpt(root, 20)
    (broken / L.MANIFEST).write_text("{not json")
    records = {r.step: r for r in read_stats(root)}
    assert records[5].blocked_seconds is None and records[10].blocked_seconds > 0
    assert records[15].write_seconds is None and records[15].stage_seconds is None
    assert records[15].wait_seconds is None  # a bool is not a number of seconds
    assert records[20].error and "unreadable manifest" in records[20].error
    code, out, err = run(capsys, "stats", str(root))
    assert code == 0, err
    assert "step 20" in out and "unreadable" in out
    summary = summarize(list(records.values()))
    assert summary["with_figures"] == 1


def test_stats_cli_errors(tmp_path, capsys):
    code, _, err = run(capsys, "stats", str(tmp_path / "missing"))
    assert code == 1 and "no such directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "stats", str(empty))
    assert code == 1 and "no checkpoints found" in err


def test_stats_help_does_not_import_torch(tmp_path):
    code = (
        "import sys\n"
        "import asyncckpt.cli as c\n"
        f"for argv in (['stats', '--help'], ['stats', {str(tmp_path)!r}]):\n"
        "    try:\n"
        "        c.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "import asyncckpt.tensorboard\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad[:5]\n"
        "assert 'matplotlib' not in sys.modules\n"
        "print('clean')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "clean" in proc.stdout


# -- TensorBoard ------------------------------------------------------------------------------


def test_tensorboard_logger_writes_the_figures(tmp_path):
    pytest.importorskip("tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from asyncckpt import SyncCheckpointEngine
    from asyncckpt.tensorboard import SCALARS, TensorBoardLogger

    log_dir = tmp_path / "tb"
    logger = TensorBoardLogger(log_dir)
    stats = []

    def on_commit(s):
        logger(s)
        stats.append(s)

    state = {"w": torch.randn(64, 64)}
    with SyncCheckpointEngine(tmp_path / "ckpts", on_commit=on_commit) as engine:
        for step in (3, 6):
            engine.save(step, state)
    logger.close()
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert sorted(tags) == sorted(f"checkpoint/{name}" for name in SCALARS)
    for name in SCALARS:
        events = acc.Scalars(f"checkpoint/{name}")
        assert [e.step for e in events] == [3, 6]
        for e, s in zip(events, stats, strict=True):
            want = getattr(s, name)
            assert e.value == pytest.approx(want, rel=1e-6, abs=1e-9), name  # float32
            assert e.wall_time == pytest.approx(s.committed_at)
    assert stats[0].bytes > 64 * 64 * 4


def test_tensorboard_logger_uses_a_given_writer(tmp_path):
    pytest.importorskip("tensorboard")
    from asyncckpt import SaveStats
    from asyncckpt.tensorboard import TensorBoardLogger

    class Writer:
        def __init__(self):
            self.calls = []
            self.flushed = 0
            self.closed = False

        def add_scalar(self, tag, value, global_step=None, walltime=None):
            self.calls.append((tag, value, global_step))

        def flush(self):
            self.flushed += 1

        def close(self):
            self.closed = True

    w = Writer()
    logger = TensorBoardLogger(writer=w, prefix="ckpt/")
    logger(SaveStats(7, stage_seconds=0.5, wait_seconds=0.25, write_seconds=2.0, bytes=100))
    assert w.flushed == 1  # at each commit: a running TensorBoard shows it at once
    logger.close()
    logger(SaveStats(8))  # a commit after close is not logged
    calls = {tag: (value, step) for tag, value, step in w.calls}
    assert calls["ckpt/blocked_seconds"] == (0.75, 7)
    assert calls["ckpt/throughput_bytes_per_s"] == (50.0, 7)
    assert not w.closed  # the caller's writer is the caller's to close
    assert all(step == 7 for _, _, step in w.calls)


def test_tensorboard_logger_needs_a_place(tmp_path):
    from asyncckpt.tensorboard import TensorBoardLogger

    with pytest.raises(ValueError, match="log_dir"):
        TensorBoardLogger()


# -- the docs page's snippet (docs/how-to/pytorch-loop.md) -----------------------------------------

README_SNIPPET = """
import tempfile

import torch

from asyncckpt import SyncCheckpointEngine
from asyncckpt.stats import read_stats, summarize

root = tempfile.mkdtemp(prefix="stats-demo-")
model = torch.nn.Linear(128, 128)
with SyncCheckpointEngine(root) as engine:
    for step in (1, 2, 3):
        engine.save(step, {"model": model})

for r in read_stats(root):  # what `python -m asyncckpt stats ROOT` shows
    print(
        f"step {r.step}: {r.bytes} bytes, stalled {r.blocked_seconds:.4f}s, "
        f"written in {r.write_seconds:.3f}s ({r.throughput_bytes_per_s / 1e6:.1f} MB/s)"
    )
print(summarize(read_stats(root)))
"""


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, re.S | re.M)


def test_docs_page_snippet_runs(tmp_path):
    doc = (REPO / "docs" / "how-to" / "pytorch-loop.md").read_text()
    assert README_SNIPPET.strip() in doc  # the test runs what the section shows
    script = tmp_path / "snippet.py"
    script.write_text(README_SNIPPET)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["step 1", "step 2", "step 3"]
    assert "'with_figures': 3" in lines[3] and "'total_bytes'" in lines[3]


def test_docs_page_tensorboard_snippet_runs(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    blocks = python_blocks((REPO / "docs" / "how-to" / "pytorch-loop.md").read_text())
    assert README_SNIPPET.strip() in [b.strip() for b in blocks]
    (tb,) = [b for b in blocks if b.startswith("# requires: tensorboard\n")]
    script = tmp_path / "snippet.py"
    script.write_text(tb)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    log_dir = proc.stdout.split("--logdir", 1)[1].strip()
    acc = EventAccumulator(log_dir)
    acc.Reload()
    assert [e.step for e in acc.Scalars("checkpoint/write_seconds")] == [10, 20]
