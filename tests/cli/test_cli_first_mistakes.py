"""The CLI's hints for a new user's first mistakes: a step directory passed as the root (every
subcommand that takes a root says to pass its parent) and ``ls``'s committed total below the
sum of its rows (the bytes differential saves share by hard links are said)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_cli import make_ckpt  # a committed checkpoint as the engine leaves it

from asyncckpt import KeepAll, SyncCheckpointEngine
from asyncckpt.cli import main
from asyncckpt.core import layout as L


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("layout", ["global_step", "megatron"])
@pytest.mark.parametrize(
    "argv",
    [["verify"], ["ls"], ["stats"], ["prune", "--keep-last", "1", "--dry-run"], ["start-fresh"]],
    ids=["verify", "ls", "stats", "prune", "start-fresh"],
)
def test_a_step_directory_as_the_root_says_to_pass_its_parent(tmp_path, capsys, argv, layout):
    root = tmp_path / "ckpts"
    step_dir = make_ckpt(root, 1000, layout=layout)
    code, out, err = run(capsys, *argv, str(step_dir))
    said = out + err
    assert code == 1, said
    assert f"{step_dir} is a checkpoint directory, not a checkpoint root" in said, said
    assert f"pass its parent ({root})" in said, said
    assert "no checkpoints found" not in said, said
    assert sorted(os.listdir(step_dir)) == ["__0_0.distcp", L.MANIFEST]  # untouched


def test_a_root_named_like_a_step_that_holds_checkpoints_is_a_root(tmp_path, capsys):
    root = tmp_path / "global_step_7"  # an odd name for a root, but a root all the same
    make_ckpt(root, 10)
    code, out, err = run(capsys, "verify", str(root))
    assert code == 0 and "is a checkpoint directory" not in out + err, out + err


def _differential_root(tmp_path: Path) -> Path:
    """Saves of which the last links its unchanged files (differential) to the one before."""
    root = tmp_path / "ckpts"
    # 1 MiB each: a file of its own, linked into the next save while unchanged
    g = torch.Generator().manual_seed(0)
    state = {"model": {k: torch.randn(256, 1024, generator=g) for k in ("a", "b", "c")}}
    with SyncCheckpointEngine(root, keep=KeepAll()) as engine:
        for step in (1, 2, 3):  # step 3 links step 2's (step 1 shares none with step 2)
            stats = engine.save(step, state).committed_sync()
            state["model"]["b"] += 1
    assert stats.files_linked >= 1, stats  # the premise: unchanged files are hard links
    return root


def _linked_bytes(root: Path) -> int:
    """Bytes of the files found in more than one checkpoint, counted beyond the first."""
    seen: set[tuple[int, int]] = set()
    shared = 0
    for d in sorted(root.glob("global_step_*")):
        for f in d.rglob("*"):
            st = f.lstat()
            if f.is_file() and st.st_nlink > 1:
                key = (st.st_dev, st.st_ino)
                shared += st.st_size if key in seen else 0
                seen.add(key)
    return shared


def test_ls_says_how_much_hard_links_share(tmp_path, capsys):
    root = _differential_root(tmp_path)
    shared = _linked_bytes(root)
    assert shared >= 1 << 20
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    (line,) = [x for x in out.splitlines() if x.startswith("tracker:")]
    assert "shared by hard links" in line, out
    code, out, _ = run(capsys, "ls", str(root), "--json")
    usage = json.loads(out)["usage"]
    assert usage["linked_bytes"] == shared, usage


def test_ls_without_links_says_nothing_of_them(tmp_path, capsys):
    root = tmp_path / "ckpts"
    make_ckpt(root, 1)
    make_ckpt(root, 2)
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0 and "hard links" not in out, out
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert json.loads(out)["usage"]["linked_bytes"] == 0
