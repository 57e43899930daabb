"""Both tiers keep the ``CommittedStore`` protocol alike (issue 12): the local root and an
object store (moto's S3 server) are put through the same checks."""

from __future__ import annotations

import pytest
import torch

from asyncckpt import SyncCheckpointEngine
from asyncckpt import layout as L
from asyncckpt.storage import CommittedStore, LocalStore

pytest_plugins = ("s3server",)  # the s3 fixture: moto's S3 server on loopback


def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """A store holding steps 1 and 2, committed the tier's way; its tracker names 2."""
    local = tmp_path / "root"
    with SyncCheckpointEngine(local) as eng:
        eng.save(1, state(1))
        eng.save(2, state(2))
    if request.param == "local":
        return LocalStore(local)
    from asyncckpt.storage.fsspec_store import FsspecStore

    s3 = request.getfixturevalue("s3")
    store = FsspecStore(s3.url, s3.options)
    for name in ("global_step_1", "global_step_2"):
        store.publish(local / name, name)
    store.write_tracker("global_step", 2)
    return store


def break_one_byte(store, name: str) -> None:
    manifest = store.read_manifest(name)
    rel = next(r for r in manifest["files"] if r.endswith(".distcp"))
    if isinstance(store, LocalStore):
        path = store.root / name / rel
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        data = bytearray(store.fs.cat_file(store.path(name, rel)))
        data[0] ^= 0xFF
        store.fs.pipe_file(store.path(name, rel), bytes(data))


def test_the_protocol_holds_alike_on_both_tiers(store, tmp_path):
    assert isinstance(store, CommittedStore)
    assert [(c.step, c.name) for c in store.committed("global_step")] == [
        (1, "global_step_1"),
        (2, "global_step_2"),
    ]
    assert store.committed("megatron") == []
    assert store.read_manifest("global_step_2")["step"] == 2
    # Tracker: forward only.
    assert store.read_tracker() == 2
    assert not store.write_tracker("global_step", 1) and store.read_tracker() == 2
    # Checks: sizes (quick) miss a flipped byte, checksums find it.
    assert store.check("global_step_1") == [] and store.check("global_step_1", quick=True) == []
    break_one_byte(store, "global_step_1")
    assert store.check("global_step_1", quick=True) == []
    assert len(store.check("global_step_1")) == 1
    # Fetch: the same files, byte for byte.
    fetched = tmp_path / "fetched"
    store.fetch("global_step_2", fetched)
    from asyncckpt.manifest import check_dir

    assert check_dir(fetched) == []
    # Delete: at once not listed; nothing left behind once leftovers are cleaned.
    store.delete("global_step_1")
    assert [c.step for c in store.committed("global_step")] == [2]
    store.clean_leftovers("global_step")
    assert store.leftovers("global_step") == []
    with pytest.raises(FileNotFoundError):
        store.fetch("global_step_1", tmp_path / "gone")


def test_leftovers_are_listed_and_cleaned_on_both_tiers(store):
    if isinstance(store, LocalStore):
        (store.root / L.tmp_name("global_step", 3, "crashed")).mkdir()
    else:
        store.fs.pipe_file(store.path("global_step_3", "half.distcp"), b"half an upload")
    assert len(store.leftovers("global_step")) == 1
    assert [c.step for c in store.committed("global_step")] == [1, 2]
    assert len(store.clean_leftovers("global_step")) == 1
    assert store.leftovers("global_step") == []
