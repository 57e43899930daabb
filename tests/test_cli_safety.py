"""The CLI and pruning do not hurt the user: a policy's missing metric is said loudly, a prune
never leaves a root without a checkpoint that verifies, empty/missing/URL roots are clear
errors, progress bars only on a terminal, and ``--help`` does not import torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from asyncckpt import layout as L
from asyncckpt.cli import main

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def make_ckpt(
    root: Path,
    step: int,
    metrics: dict[str, float] | None = None,
    payload: bytes = b"x" * 2048,
    layout: str = "global_step",
) -> Path:
    """A committed checkpoint as the engine leaves it: one shard and a manifest (real crc32)."""
    d = root / L.dir_name(layout, step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload)
    manifest = {
        "step": step,
        "committed_at": 1_700_000_000.0 + step,
        "metrics": metrics or {},
        "bytes": len(payload),
        "files": {"__0_0.distcp": {"size": len(payload), "crc32": zlib.crc32(payload)}},
        "run_id": "run-a",
    }
    (d / L.MANIFEST).write_text(json.dumps(manifest))
    return d


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


# -- 4: object-storage roots are refused -------------------------------------------------------


@pytest.mark.parametrize(
    "url", ["s3://bucket/run", "gs://b/x", "az://c/d", "hf+s3://x", "file://tmp"]
)
def test_check_local_root_refuses_urls(url):
    from asyncckpt.errors import CheckpointError
    from asyncckpt.paths import UnsupportedStorage, check_local_root

    with pytest.raises(UnsupportedStorage, match="object storage is not supported yet") as info:
        check_local_root(url)
    assert url in str(info.value)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)


def test_check_local_root_accepts_paths(tmp_path):
    from asyncckpt.paths import check_local_root

    assert check_local_root(tmp_path) == tmp_path
    assert check_local_root(str(tmp_path / "a:b")) == tmp_path / "a:b"
    assert check_local_root("relative/dir") == Path("relative/dir")
    assert check_local_root("c:/odd") == Path("c:/odd")  # no '//': not a URL


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["prune", "--keep-last", "1"]])
def test_cli_refuses_url_roots(capsys, command):
    code, out, err = run(capsys, command[0], "s3://bucket/run", *command[1:])
    assert code == 1
    assert "object storage is not supported yet" in err and "s3://bucket/run" in err
    assert "Traceback" not in err
