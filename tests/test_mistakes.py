"""A user's mistakes get clear errors before anything is written (issue 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncckpt import CheckpointEngine, SyncCheckpointEngine


def test_sync_with_on_the_async_engine_points_to_the_sync_engine(tmp_path):
    engine = CheckpointEngine(tmp_path / "ckpts")
    with pytest.raises(TypeError, match="SyncCheckpointEngine"):
        with engine:
            pass
    assert not (tmp_path / "ckpts").exists()  # nothing started, nothing written


def test_sync_engine_still_works_as_a_context_manager(tmp_path):
    with SyncCheckpointEngine(tmp_path / "ckpts", handle_sigterm=False) as engine:
        engine.save(1, {"x": 1})
    assert engine.latest_step() == 1


@pytest.mark.parametrize(
    "root, match",
    [
        ("nosuchfs://bucket/run", "no fsspec back-end knows nosuchfs://"),
        (Path("s3://bucket/run"), "a Path\\(\\) of a URL has lost a '/'"),
    ],
)
def test_url_roots_nothing_can_serve_are_refused_before_anything_is_written(
    tmp_path, monkeypatch, root, match
):
    from asyncckpt import CheckpointError, UnsupportedStorage

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorage, match=match) as e:
        SyncCheckpointEngine(root, handle_sigterm=False)
    assert isinstance(e.value, CheckpointError)
    assert list(tmp_path.iterdir()) == []  # no local directory named "s3:"
