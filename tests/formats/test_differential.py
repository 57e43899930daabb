"""Differential saves (issue 37, worker side; invariant 15): a shard file whose bytes would be the
previous checkpoint's is a hard link to it. A wrong "unchanged" is silent corruption, so every
mutation path the torn-state tests know is made between two saves, step 1 is pruned, and step 2
is read back with a plain ``dcp.load`` (no asyncckpt) bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from statecmp import assert_same

from asyncckpt import KeepLast, Staging, SyncCheckpointEngine, verify
from asyncckpt.core import layout
from asyncckpt.storage import RemoteTier
from asyncckpt.storage.fsspec_store import FsspecStore

pytest_plugins = ("s3server",)  # the s3 fixture (test_s3.py): moto's S3 server on loopback

BIG = (256, 1024)  # 1 MiB of float32: a file of its own (differential.OWN_FILE_BYTES)


def state_of() -> dict:
    g = torch.Generator().manual_seed(0)
    model = {k: torch.randn(BIG, generator=g) for k in ("a", "b", "c", "d")}
    model["small"] = torch.arange(16.0)
    return {"model": model, "step": 1}


def fresh_like(state: dict) -> dict:
    return {
        "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
        "step": 0,
    }


def flip_one_bit(t: torch.Tensor) -> None:
    t.view(torch.int32)[5, 5] ^= 1  # the smallest change there is


#: Every way the torn-state tests know to change a tensor's bytes (tests/storage/test_torn_storage.py),
#: and the ones version counters miss (``.data``, NumPy views, weight syncs by ``.data.copy_``).
MUTATIONS = {
    "in_place_op": lambda t: t.mul_(2),
    "one_bit": flip_one_bit,
    "data_write": lambda t: t.data.__setitem__((0, 0), 42.0),
    "data_copy_": lambda t: t.data.copy_(torch.full(BIG, 3.0)),
    "numpy_view": lambda t: t.numpy().__setitem__((7, 7), -1.0),
    "set_": lambda t: t.set_(torch.full(BIG, 5.0)),
    # (Staging viewed the storage through NumPy, which makes it not resizable: shrunk.)
    "resize_": lambda t: t.resize_(BIG[0] // 2, BIG[1]).fill_(0.5),
}


def step_dir(root: Path, step: int) -> Path:
    return root / layout.dir_name("global_step", step)


def file_of(directory: Path, fqn: str) -> Path:
    """The shard file holding ``fqn`` (DCP's ``.metadata`` says where each item is)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(directory)).read_metadata()
    (name,) = {v.relative_path for k, v in md.storage_data.items() if k.fqn == fqn}
    return directory / name


def plain_load(directory: Path, want: dict) -> dict:
    target = fresh_like(want)
    dcp.load(target, checkpoint_id=str(directory), no_dist=True)
    return target


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_every_mutation_between_saves_is_written_and_loads_after_step_1_is_pruned(
    tmp_path, mutation
):
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        engine.save(1, state).committed_sync()
        MUTATIONS[mutation](state["model"]["a"])
        stats = engine.save(2, state).committed_sync()
    assert not step_dir(tmp_path, 1).exists()  # pruned: step 2 stands alone
    # b, c, d and the file of small tensors and objects linked; a (changed) written (shrunk
    # under 1 MiB by resize_, it joins the small tensors' file).
    assert stats.files_linked == (3 if mutation == "resize_" else 4), stats
    assert stats.bytes_skipped >= 3 << 20 and stats.bytes_written >= 512 << 10
    assert_same(plain_load(step_dir(tmp_path, 2), state), state)
    assert verify(tmp_path).ok


def test_a_small_tensor_or_an_object_changed_rewrites_their_file_only(tmp_path):
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        engine.save(1, state).committed_sync()
        state["model"]["small"][3] = -7.0
        state["step"] = 2
        stats = engine.save(2, state).committed_sync()
    assert stats.files_linked == 4  # every big tensor's file
    assert stats.bytes_written < 1 << 20  # the file of small tensors and objects
    assert_same(plain_load(step_dir(tmp_path, 2), state), state)
    assert verify(tmp_path).ok


def test_an_unchanged_state_is_linked_not_written(tmp_path):
    """Everything kept: step 2 writes every file (linked, steps 1 and 2 would share them all,
    and one damaged file would take both); step 3 links every file from step 2 (step 1 shares
    none of them)."""
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        first = engine.save(1, state).committed_sync()
        second = engine.save(2, state).committed_sync()
        third = engine.save(3, state).committed_sync()
    assert first.files_linked == 0 and first.bytes_skipped == 0
    assert first.bytes_written >= 4 << 20
    assert second.files_linked == 0 and second.bytes_written == first.bytes_written, second
    # Nothing changed: every shard file is linked (same inode), none written.
    assert third.files_linked == 5 and third.bytes_written == 0, third
    assert third.bytes_skipped == first.bytes_written
    assert third.fingerprint_seconds > 0
    shards = sorted(p.name for p in step_dir(tmp_path, 3).glob("*.distcp"))
    for name in shards:
        assert os.path.samefile(step_dir(tmp_path, 2) / name, step_dir(tmp_path, 3) / name)
        assert not os.path.samefile(step_dir(tmp_path, 1) / name, step_dir(tmp_path, 3) / name)


def test_disk_usage_counts_a_linked_file_once(tmp_path):
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(3)) as engine:
        engine.save(1, state).committed_sync()
        one = engine.disk_usage()["committed_bytes"]
        engine.save(2, state).committed_sync()  # (every file anew: see the test above)
        two = engine.disk_usage()["committed_bytes"]
        engine.save(3, state).committed_sync()
        three = engine.disk_usage()["committed_bytes"]
    # Step 3 adds its manifest, .metadata and sidecar: well under 10% of step 1.
    assert one >= 4 << 20 and two >= 2 * one - (one // 10), (one, two)
    assert three - two < one // 10, (one, two, three)


def test_pruning_the_older_checkpoint_leaves_the_newer_whole(tmp_path):
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        engine.save(1, state).committed_sync()
        engine.save(2, state).committed_sync()
        engine.save(3, state).committed_sync()
    assert [c.step for c in verify(tmp_path).checkpoints] == [3]
    assert verify(tmp_path).ok
    assert_same(plain_load(step_dir(tmp_path, 3), state), state)
    with SyncCheckpointEngine(tmp_path) as engine:
        target = fresh_like(state)
        assert engine.load_latest(target) == 3
    assert_same(target, state)


def test_a_corrupt_shared_file_is_reported_by_every_checkpoint_that_holds_it(tmp_path):
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(3)) as engine:
        for step in (1, 2, 3):  # (step 3 links from step 2, which shares no file with 1)
            engine.save(step, state).committed_sync()
    shared = max(step_dir(tmp_path, 3).glob("*.distcp"), key=lambda p: p.stat().st_size)
    assert os.path.samefile(shared, step_dir(tmp_path, 2) / shared.name)
    with open(shared, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = verify(tmp_path)
    bad = {c.step: c.problems for c in report.checkpoints if not c.ok}
    assert set(bad) == {2, 3}, report  # step 1 holds a file of its own
    assert all(any(shared.name in p for p in problems) for problems in bad.values())


def test_a_load_falls_back_past_every_checkpoint_holding_a_corrupt_shared_file(tmp_path):
    """Step 2 writes every file (it would share them all with step 1), step 3 links them from
    step 2; a's file, damaged, fails both: the load quarantines both and restores step 1,
    whose a differs."""
    import warnings

    from asyncckpt.storage.prune import list_quarantined

    state = state_of()
    want = {"model": {k: v.clone() for k, v in state["model"].items()}, "step": 1}
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(3)) as engine:
        engine.save(1, state).committed_sync()
        state["model"]["a"].add_(1)
        engine.save(2, state).committed_sync()
        assert engine.save(3, state).committed_sync().files_linked == 5
    victim = file_of(step_dir(tmp_path, 3), "model.a")  # step 2's, linked by step 3
    assert os.path.samefile(victim, step_dir(tmp_path, 2) / victim.name)
    with open(victim, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    target = fresh_like(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with SyncCheckpointEngine(tmp_path) as engine:
            assert engine.load_latest(target) == 1
    assert_same(target, want)
    assert sorted(q.step for q in list_quarantined(tmp_path, "global_step")) == [2, 3]


def test_a_file_that_rotted_before_the_next_save_is_written_again_not_linked(tmp_path):
    """With KeepLast(2) step 4 links from step 2 (the step its prune removes; step 3 shares
    no file with it), and step 2's file of a rots (same size) before step 4. Linking it by
    size alone copied its old checksum into step 4's manifest, and the worker's prune,
    trusting step 4 as written, deleted the last checkpoint that verified. A file is linked
    only once its bytes match its checksum: step 4 writes a's file anew and stands on its own."""
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(2)) as engine:
        engine.save(1, state).committed_sync()
        state["model"]["a"].add_(1)
        engine.save(2, state).committed_sync()
        engine.save(3, state).committed_sync()  # links from step 1: a is written
        victim = file_of(step_dir(tmp_path, 2), "model.a")
        rotted = victim.stat().st_ino
        with open(victim, "r+b") as f:
            f.seek(100)
            f.write(b"\xff\xfe")
        stats = engine.save(4, state).committed_sync()
    assert stats.files_linked == 4 and stats.link_fallbacks == 1, stats
    assert file_of(step_dir(tmp_path, 4), "model.a").stat().st_ino != rotted
    assert {c.step: c.ok for c in verify(tmp_path).checkpoints} == {3: True, 4: True}
    assert_same(plain_load(step_dir(tmp_path, 4), state), state)


def test_a_new_worker_links_from_the_checkpoint_the_tracker_names(tmp_path):
    state = state_of()
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state).committed_sync()
        engine.save(2, state).committed_sync()  # (every file anew: it shares none with 1)
    state["model"]["b"].add_(1)
    with SyncCheckpointEngine(tmp_path) as engine:
        stats = engine.save(3, state).committed_sync()
    assert stats.files_linked == 4
    a = file_of(step_dir(tmp_path, 3), "model.a")
    assert os.path.samefile(a, step_dir(tmp_path, 2) / a.name)
    assert_same(plain_load(step_dir(tmp_path, 3), state), state)


def test_a_tampered_sidecar_is_not_trusted(tmp_path):
    """The fingerprints decide what is linked: a sidecar that fails its manifest entry makes
    the next save write every file."""
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(3)) as engine:
        engine.save(1, state).committed_sync()
        engine.save(2, state).committed_sync()  # (step 3 links from it: 1 shares no file)
        sidecar = step_dir(tmp_path, 2) / "__0_fingerprints.json"
        sidecar.write_text(sidecar.read_text().replace('"linked": false', '"linked": true '))
        state["model"]["a"].add_(1)
        stats = engine.save(3, state).committed_sync()
    assert stats.files_linked == 0 and stats.link_fallbacks == 1
    assert_same(plain_load(step_dir(tmp_path, 3), state), state)


def test_differential_false_writes_every_file(tmp_path):
    state = state_of()
    with SyncCheckpointEngine(tmp_path, staging=Staging(differential=False)) as engine:
        engine.save(1, state).committed_sync()
        stats = engine.save(2, state).committed_sync()
    assert stats.files_linked == 0 and stats.bytes_skipped == 0
    assert not list(step_dir(tmp_path, 2).glob("*fingerprints.json"))
    names = [p.name for p in step_dir(tmp_path, 2).glob("*.distcp")]
    assert all(os.stat(step_dir(tmp_path, 2) / n).st_nlink == 1 for n in names)


def test_writing_refuses_a_non_bool():
    with pytest.raises(TypeError, match="differential"):
        Staging(differential=1)  # type: ignore[arg-type]


def test_the_remote_tier_copies_linked_files_in_the_store_and_each_step_stands_alone(s3, tmp_path):
    """A linked file is copied by the store (server-side), not uploaded again; the store's
    step 2 loads with a plain ``dcp.load`` after its step 1 is deleted."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    tier = RemoteTier(s3.url, storage_options=s3.options)
    state = state_of()
    # (One step kept on disk: step 2 links from step 1; the store keeps both.)
    with SyncCheckpointEngine(tmp_path / "local", keep=KeepLast(1), remote=tier) as engine:
        first = engine.save(1, state).committed_sync()
        state["model"]["a"].add_(1)
        second = engine.save(2, state).committed_sync()
    assert first.uploaded_bytes >= 4 << 20
    assert second.files_linked == 4
    # a's file, the sidecar, .metadata and the manifest go up; b, c, d are copied there.
    assert (1 << 20) <= second.uploaded_bytes < 2 << 20, second
    store = FsspecStore(s3.url, s3.options)
    store.delete(layout.dir_name("global_step", 1))
    target = fresh_like(state)
    reader = FsspecReader(f"{s3.url}/global_step_2", **s3.options)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, state)


def test_a_store_step_holding_another_saves_bytes_is_neither_copied_from_nor_taken_as_up(
    s3, tmp_path
):
    """The local root is lost while the bucket is kept, and the run saves step 1 again with
    other values. Step 1 was taken as uploaded (the store holds *a* step 1), and step 2's
    files linked to the new local step 1 were copied inside the store from the store's old
    step 1: its step 2 failed its checksums. Now step 1's save fails (UploadFailed: the
    store holds another save of it), and step 2 uploads what the store does not hold."""
    import shutil

    from asyncckpt import UploadFailed

    tier = RemoteTier(s3.url, storage_options=s3.options)
    with SyncCheckpointEngine(tmp_path / "local", remote=tier) as engine:
        engine.save(1, state_of()).committed_sync()
    shutil.rmtree(tmp_path / "local")
    state = state_of()
    for v in state["model"].values():
        v.add_(1)
    # (One step kept on disk: step 2 may link from the new step 1.)
    with SyncCheckpointEngine(tmp_path / "local", keep=KeepLast(1), remote=tier) as engine:
        with pytest.raises(UploadFailed, match="another save of step 1"):
            engine.save(1, state).committed_sync()
        second = engine.save(2, state).committed_sync()
    assert second.files_linked == 5
    assert second.uploaded_bytes >= 4 << 20, second  # nothing of it was in the store
    store = FsspecStore(s3.url, s3.options)
    assert {c.step: store.check(c.name) for c in store.committed("global_step")} == {
        1: [],
        2: [],
    }


def test_a_store_object_damaged_since_its_upload_is_not_copied_into_the_next_step(s3, tmp_path):
    """Bit rot in the store's step 2 (same sizes): step 3's linked files were copied from it
    inside the store, unread, and the new step was trusted by the store's prune, which left
    the store holding only a damaged step 3 though every local byte was whole. Each object is
    now checksummed before the store copies it; a damaged one is uploaded from the local file
    instead (the worker's log names it). (Step 2 writes every file on disk: it would share
    them all with step 1; step 3 links from it.)"""
    tier = RemoteTier(s3.url, storage_options=s3.options, keep=KeepLast(1))
    store = FsspecStore(s3.url, s3.options)
    state = state_of()
    with SyncCheckpointEngine(tmp_path / "local", keep=None, remote=tier) as engine:
        engine.save(1, state).committed_sync()
        engine.save(2, state).committed_sync()
        fs = s3.fs()
        damaged = sorted(
            o
            for o in fs.find(store.path(layout.dir_name("global_step", 2)))
            if o.endswith(".distcp")
        )
        assert len(damaged) >= 2
        for obj in damaged[:-1]:  # every shard but one: that one is still copied
            data = bytearray(fs.cat_file(obj))
            data[len(data) // 2] ^= 0xFF
            fs.pipe_file(obj, bytes(data))
        assert store.check(layout.dir_name("global_step", 2))
        state["model"]["a"].add_(1)
        third = engine.save(3, state).committed_sync()
    local3 = tmp_path / "local" / layout.dir_name("global_step", 3)
    linked = {p.name for p in local3.glob("*.distcp") if p.stat().st_nlink > 1}
    copied_from_damage = linked & {o.rsplit("/", 1)[-1] for o in damaged[:-1]}
    assert third.files_linked >= len(linked) and copied_from_damage, (linked, damaged)
    store = FsspecStore(s3.url, s3.options)
    assert [c.step for c in store.committed("global_step")] == [3]
    assert store.check(layout.dir_name("global_step", 3)) == []
    # Uploaded: a's file (changed), every linked one whose object was damaged, and the small
    # files (.metadata, the sidecar, the manifest: under 64 KiB); the linked shard whose
    # object was whole (1 MiB) is still copied in the store.
    shards = {p.name: p.stat().st_size for p in local3.glob("*.distcp")}
    want = sum(size for name, size in shards.items() if name not in linked - copied_from_damage)
    assert linked - copied_from_damage, linked
    assert want <= third.uploaded_bytes < want + (64 << 10), (want, third.uploaded_bytes)
    target = fresh_like(state)
    dcp.load(
        target, checkpoint_id=tmp_path / "local" / layout.dir_name("global_step", 3), no_dist=True
    )
    assert_same(target, state)


def test_megatron_torch_dist_links_unchanged_files_and_megatron_loads_them(tmp_path):
    """torch_dist's shards are DCP files found through ``.metadata`` (megatron's loader never
    reads a file name): they are linked as plain DCP's. Step 1 pruned, step 2 is read back by
    our reader and by megatron's own loader in a fresh interpreter, bit for bit."""
    import megatron_helpers as mh
    from test_formats_megatron import _has_megatron, _megatron_load

    state = mh.plain_state()
    state["frozen"] = torch.randn(BIG)  # a file of its own
    with SyncCheckpointEngine(tmp_path, "megatron", keep=KeepLast(1)) as engine:
        engine.save(1, state).committed_sync()
        stats = engine.save(2, state).committed_sync()
    assert stats.files_linked >= 2 and stats.bytes_skipped > BIG[0] * BIG[1] * 4
    assert stats.link_fallbacks == 0 and stats.fingerprint_reused_bytes == BIG[0] * BIG[1] * 4
    step2 = tmp_path / layout.dir_name("megatron", 2)
    assert not (tmp_path / layout.dir_name("megatron", 1)).exists()
    assert verify(tmp_path).ok
    target = mh.plain_state()
    target["model"]["w"].zero_()
    target["frozen"] = torch.zeros(BIG)
    assert SyncCheckpointEngine(tmp_path, "megatron").load_latest(target) == 2
    assert_same(target, state)
    if _has_megatron():  # megatron's loader: the state without the extra tensor
        with SyncCheckpointEngine(tmp_path / "m", "megatron", keep=KeepLast(1)) as engine:
            engine.save(1, mh.plain_state()).committed_sync()
            assert engine.save(2, mh.plain_state()).committed_sync().files_linked > 0
        assert not (tmp_path / "m" / layout.dir_name("megatron", 1)).exists()
        _megatron_load("plain", tmp_path / "m" / layout.dir_name("megatron", 2))
    assert step2.is_dir()


def test_a_previous_checkpoint_pruned_while_its_fingerprints_are_read_is_written_anew(
    tmp_path, monkeypatch
):
    """Another process's prune removed the previous checkpoint between the read of its
    fingerprints and the look at their file: the save failed with FileNotFoundError. Nothing
    is linked then; every file is written (and the fallback says why)."""
    from asyncckpt.formats import differential

    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        engine.save(1, state_of()).committed_sync()
    previous = step_dir(tmp_path, 1)
    real_read_json = differential._read_json

    def read_then_pruned(path):
        out = real_read_json(path)
        if path.name.endswith(differential.SIDECAR):
            (previous / path.name).unlink()  # (as a prune renaming the step away would)
        return out

    monkeypatch.setattr(differential, "_read_json", read_then_pruned)
    linker = differential.Linker(
        location=tmp_path / "new", prefix="__0_", previous=previous, seed="s"
    )
    assert linker.fallbacks and "went while read" in linker.fallbacks[0], linker.fallbacks
