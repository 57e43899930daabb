"""Both tiers keep the ``CommittedStore`` protocol alike (issue 12): the local root and an
object store (moto's S3 server) are put through the same checks."""

from __future__ import annotations

import pytest
import torch

from asyncckpt import SyncCheckpointEngine
from asyncckpt.core import layout as L
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
    from asyncckpt.storage.manifest import check_dir

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


# ------------------------------------------------------------------ every operation (issue 23)
def files_of(store, name: str, tmp_path) -> dict[str, bytes]:
    out = tmp_path / f"files-{name}-{len(list(tmp_path.iterdir()))}"
    store.fetch(name, out)
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_stage_seal_publish_is_the_commit_on_both_tiers(store, tmp_path):
    """A new checkpoint made through the store: invisible until published, then committed."""
    from asyncckpt.storage import commit

    source = tmp_path / "source"
    store.fetch("global_step_2", source)
    staged = store.stage("global_step_3")
    assert staged.is_dir() and list(staged.iterdir()) == []
    assert not L.parse_dir_name("global_step", staged.name)  # never a checkpoint name
    for p in source.rglob("*"):
        if p.is_file():
            (staged / p.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (staged / p.relative_to(source)).write_bytes(p.read_bytes())
    sizes = []
    store.seal(staged, "global_step_3", sizes.append)
    assert [c.step for c in store.committed("global_step")] == [1, 2]  # sealed: not visible
    commit.publish(store, staged, "global_step_3")
    assert [c.step for c in store.committed("global_step")] == [1, 2, 3]
    assert store.check("global_step_3") == []
    assert files_of(store, "global_step_3", tmp_path) == files_of(store, "global_step_2", tmp_path)
    # Never replaced in place.
    again = store.stage("global_step_3")
    (again / "x").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        commit.publish(store, again, "global_step_3")
    store.discard(again)
    store.clean_leftovers("global_step")
    assert store.leftovers("global_step") == []
    # The tracker through the commit order, forward only.
    assert commit.write_tracker(store, "global_step", 3) and store.read_tracker() == 3
    assert store.has_tracker()
    assert not commit.write_tracker(store, "global_step", 2) and store.read_tracker() == 3
    desc = store.describe(store.committed("global_step")[-1])
    assert desc.step == 3 and desc.size_bytes > 0


def test_retire_then_reclaim_is_the_delete_on_both_tiers(store):
    retired = store.retire("global_step_1")
    assert [c.step for c in store.committed("global_step")] == [2]  # at once out of the list
    store.reclaim(retired)
    assert not store.exists("global_step_1")
    assert store.leftovers("global_step") == []
    with pytest.raises(FileNotFoundError):
        store.retire("global_step_1")


def test_a_crash_between_retire_and_reclaim_leaves_a_leftover_only(store):
    from asyncckpt import faults
    from asyncckpt.storage import prune

    faults.inject(store.points.retire, "raise")
    try:
        with pytest.raises(RuntimeError):
            prune.delete(store, "global_step_1")
    finally:
        faults.clear()
    assert [c.step for c in store.committed("global_step")] == [2]
    assert len(store.leftovers("global_step")) == 1
    assert len(store.clean_leftovers("global_step")) == 1


def test_quarantine_and_locks(store):
    from asyncckpt.errors import UnsupportedStorage

    if isinstance(store, LocalStore):
        where = store.quarantine("global_step_1", ["x.distcp: checksum mismatch"])
        assert ".quarantine" in where and [c.step for c in store.committed("global_step")] == [2]
        fd = store.lock("rank9", wait=False)
        assert fd is not None
        assert store.lock("rank9", wait=False) is None  # held: a second engine is refused
        from asyncckpt.storage.localfs import unlock

        unlock(fd)
        fd = store.lock("rank9", wait=False)
        assert fd is not None
        unlock(fd)
    else:  # no rename and no locks on an object store: said clearly, nothing changed
        with pytest.raises(UnsupportedStorage):
            store.quarantine("global_step_1", ["bad"])
        with pytest.raises(UnsupportedStorage):
            store.lock("rank0", wait=False)
        assert [c.step for c in store.committed("global_step")] == [1, 2]


def test_both_tiers_refuse_to_guess_a_mixed_layout(store, tmp_path):
    """layout.py's rule for every store: several layouts in one root is an error (the object
    store used to pick the first silently, and prune it by the wrong names)."""
    from asyncckpt.storage import commit

    assert store.detect_layout() == "global_step"
    source = tmp_path / "source"
    store.fetch("global_step_2", source)
    commit.publish(store, source, "iter_0000007")
    with pytest.raises(ValueError, match="several layouts"):
        store.detect_layout()


def test_open_store_picks_the_tier_of_a_path_or_a_url(tmp_path):
    from asyncckpt.storage import open_store
    from asyncckpt.storage.fsspec_store import FsspecStore

    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store("memory://run"), FsspecStore)
    with pytest.raises(ValueError, match="storage options"):
        open_store(tmp_path, {"endpoint_url": "http://x"})


# ------------------------------------------------------------------ one pruner, both tiers
def test_the_pruner_keeps_the_newest_that_verifies_on_both_tiers(store):
    from asyncckpt import KeepLast
    from asyncckpt.storage.prune import NEWEST_THAT_VERIFIES, prune

    break_one_byte(store, "global_step_2")
    result = prune(store, "global_step", KeepLast(1), warn=False)
    assert result.deleted == [] and result.kept[1] == [NEWEST_THAT_VERIFIES]
    assert 2 in result.corrupt
    assert [c.step for c in store.committed("global_step")] == [1, 2]


def test_the_pruner_never_deletes_when_nothing_verifies_on_both_tiers(store):
    from asyncckpt import KeepLast
    from asyncckpt.storage.prune import PruneRefused, prune

    break_one_byte(store, "global_step_1")
    break_one_byte(store, "global_step_2")
    with pytest.raises(PruneRefused, match="verifies"):
        prune(store, "global_step", KeepLast(1), warn=False)
    assert [c.step for c in store.committed("global_step")] == [1, 2]


def test_the_pruner_refuses_a_lagging_tracker_and_spares_the_step_committed(store):
    from asyncckpt import KeepLast
    from asyncckpt.storage.prune import PruneRefused, prune

    with pytest.raises(PruneRefused, match="tracker"):
        prune(store, "global_step", KeepLast(1), tracker_step=1)
    result = prune(store, "global_step", KeepLast(1), committed_step=1, trusted=(1,), warn=False)
    assert result.deleted == []  # the step just committed and everything above it stay
    result = prune(store, "global_step", KeepLast(1), warn=False)
    assert result.deleted == [1] and [c.step for c in store.committed("global_step")] == [2]


# ------------------------------------------------------------------ one CLI over both tiers
def test_the_cli_answers_alike_over_a_path_and_a_url(s3, tmp_path, capsys):
    """ls, verify and prune are one function each over ``open_store(root)``: the same root
    as a directory and as a bucket gives the same answers, a corrupt newest checkpoint
    included (the URL prune used to refuse outright where the local one keeps the newest
    that verifies)."""
    import json

    from asyncckpt.cli import main
    from asyncckpt.storage import commit
    from asyncckpt.storage.fsspec_store import FsspecStore

    local = tmp_path / "root"
    with SyncCheckpointEngine(local) as eng:
        for step in (1, 2, 3):
            eng.save(step, state(step), metrics={"loss": 1.0 / step})
    remote = FsspecStore(s3.url, s3.options)
    for name in ("global_step_1", "global_step_2", "global_step_3"):
        commit.publish(remote, local / name, name)
    commit.write_tracker(remote, "global_step", 3)
    opts = [f"--storage-option={k}={v}" for k, v in s3.options.items()]

    def run(*argv: str) -> tuple[tuple[int, dict], tuple[int, dict]]:
        out = []
        for root, extra in ((str(local), []), (s3.url, opts)):
            code = main([*argv, root, "--json", *extra])
            out.append((code, json.loads(capsys.readouterr().out)))
        return out[0], out[1]

    def ls_view(d: dict) -> tuple:
        rows = [(c["step"], c["status"], c["protected"], c["metrics"]) for c in d["checkpoints"]]
        return d["layout"], d["tracker"], rows, d["leftovers"], d["checked"]

    (lc, ld), (rc, rd) = run("ls")
    assert lc == rc == 0 and ls_view(ld) == ls_view(rd)
    assert [c["step"] for c in ld["checkpoints"]] == [1, 2, 3]

    def verify_view(d: dict) -> tuple:
        rows = [(c["step"], c["ok"], len(c["problems"])) for c in d["checkpoints"]]
        return d["ok"], rows, d["tracker"], d["tracker_problem"], d["newest_good"]

    (lc, ld), (rc, rd) = run("verify")
    assert lc == rc == 0 and verify_view(ld) == verify_view(rd)
    local_store = LocalStore(local)
    break_one_byte(local_store, "global_step_3")
    break_one_byte(remote, "global_step_3")
    (lc, ld), (rc, rd) = run("verify")
    assert lc == rc == 1 and verify_view(ld) == verify_view(rd)
    assert ld["newest_good"] == 2

    def prune_view(d: dict) -> tuple:
        return d["deleted"], d["would_delete"], d["kept"], sorted(d["corrupt"])

    (lc, ld), (rc, rd) = run("prune", "--keep-last", "1", "--dry-run")
    assert lc == rc == 0 and prune_view(ld) == prune_view(rd)
    (lc, ld), (rc, rd) = run("prune", "--keep-last", "1")
    assert lc == rc == 0 and prune_view(ld) == prune_view(rd)
    assert ld["deleted"] == [1] and ld["kept"]["2"] == ["newest that verifies"]
    assert [c.step for c in remote.committed("global_step")] == [2, 3]
    assert [c.step for c in local_store.committed("global_step")] == [2, 3]


def test_a_local_seal_makes_the_names_in_every_sub_directory_durable(tmp_path, monkeypatch):
    """A file's name is durable once its directory is fsynced. The seal fsynced the step's
    own directory only, so the names of files in its sub-directories (components' `model/`,
    a fetched replica's or a node commit's nested files, which the writers leave to the
    seal) could be lost to a power cut after the commit was announced."""
    import os

    from asyncckpt.storage import localfs

    store = LocalStore(tmp_path / "root")
    store.create_root()
    staged = store.stage(L.dir_name("global_step", 3), "tok")
    for rel in ("top.bin", "model/__0_0.distcp", "optim/state/deep/__0_0.distcp"):
        (staged / rel).parent.mkdir(parents=True, exist_ok=True)
        (staged / rel).write_bytes(b"x")
    (staged / "empty").mkdir()
    synced: list[str] = []
    real = localfs.os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(localfs.os, "fsync", spy)
    store.seal(staged, staged.name)
    want = {str(p) for p in [staged, *staged.rglob("*")] if p.is_dir()}
    assert want == {
        str(staged / d) for d in ("", "model", "optim", "optim/state", "optim/state/deep", "empty")
    }
    assert want <= set(synced), sorted(want - set(synced))
    # Deepest first: a directory's own name is made durable after what it holds.
    assert synced.index(str(staged / "optim/state/deep")) < synced.index(str(staged / "optim"))
    assert synced[-1] == str(staged)
