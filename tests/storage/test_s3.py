"""Object storage (issue 12): checkpoints published to a real S3 API (moto server on loopback).

The store's rules (invariant 10): a checkpoint is committed exactly when its marker exists,
written after every file and deleted before them; nothing without a marker is listed, loaded
or verified. The engine writes and commits locally first, then publishes; a save's handle
resolves once the checkpoint is committed in the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from statecmp import assert_same

from asyncckpt import (
    Distributed,
    KeepEvery,
    KeepLast,
    ObjectStore,
    SyncCheckpointEngine,
    ThrottleConfig,
    faults,
)
from asyncckpt.core import layout as L
from asyncckpt.storage import RemoteTier, UploadFailed, commit, prune
from asyncckpt.storage.fsspec_store import FsspecStore

pytest_plugins = ("s3server",)  # the s3 fixture: moto's S3 server on loopback

#: How long a test waits for a commit: a bound against a hang, never a speed check. The niced
#: worker, starting and importing s3fs for its first upload, took over 60 s beside two busy
#: processes on a 2-core machine (the first test of a CI run failed at 60 s).
COMMIT_WAIT = 300


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}
    return {"model": model, "step_count": seed, "opt": {"lr": 0.1 * seed}}


def blank() -> dict:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
        "step_count": -1,
        "opt": {"lr": 0.0},
    }


def committed_locally(root, *steps: int):
    """A local root with ``steps`` committed by the engine, and a store to publish them to."""
    with SyncCheckpointEngine(root) as eng:
        for step in steps:
            eng.save(step, make_state(step))
    return root


def remote_steps(s3) -> list[int]:
    return [c.step for c in FsspecStore(s3.url, s3.options).committed("global_step")]


# ------------------------------------------------------------------ the store on its own
def test_marker_makes_the_commit_and_goes_first(s3, tmp_path):
    local = committed_locally(tmp_path / "root", 1, 2)
    store = FsspecStore(s3.url, s3.options)
    store.publish(local / "global_step_1", "global_step_1")
    fs = s3.fs()
    # Every file of the checkpoint went up, manifest included, and the marker with them.
    assert sorted(p.split("/")[-1] for p in fs.find(f"{s3.bucket}/run/global_step_1")) == sorted(
        [*(p.name for p in (local / "global_step_1").iterdir()), L.COMMIT_MARKER]
    )
    assert [c.step for c in store.committed("global_step")] == [1]
    assert store.check("global_step_1") == []
    # An upload cut before its marker: the files are there, the checkpoint is not.
    faults.inject("before_marker", "raise")
    with pytest.raises(RuntimeError):  # (the commit order announces the store's fault points)
        commit.publish(store, local / "global_step_2", "global_step_2")
    assert fs.exists(f"{s3.bucket}/run/global_step_2/{L.MANIFEST}")
    assert [c.step for c in store.committed("global_step")] == [1]
    with pytest.raises(FileNotFoundError, match="not committed"):
        store.fetch("global_step_2", tmp_path / "fetched")
    assert store.clean_leftovers("global_step") == ["global_step_2"]
    assert not fs.exists(f"{s3.bucket}/run/global_step_2")
    # A committed step is never overwritten in place.
    with pytest.raises(FileExistsError):
        store.publish(local / "global_step_1", "global_step_1")
    # Delete: marker first; a crash after it leaves no checkpoint, only files to clean.
    faults.inject("mid_remote_prune", "raise")
    with pytest.raises(RuntimeError):  # (the pruner announces it between retire and reclaim)
        prune.delete(store, "global_step_1")
    assert store.committed("global_step") == []
    assert fs.exists(f"{s3.bucket}/run/global_step_1/{L.MANIFEST}")
    assert store.clean_leftovers("global_step") == ["global_step_1"]


def test_store_check_finds_a_corrupt_or_missing_file(s3, tmp_path):
    local = committed_locally(tmp_path / "root", 3)
    store = FsspecStore(s3.url, s3.options)
    store.publish(local / "global_step_3", "global_step_3")
    fs = s3.fs()
    shard = next(p for p in fs.find(f"{s3.bucket}/run/global_step_3") if p.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    problems = store.check("global_step_3")
    assert len(problems) == 1 and "mismatch" in problems[0]
    fs.rm_file(shard)
    assert store.check("global_step_3") == [f"{shard.split('/')[-1]}: missing"]


def test_remote_tracker_moves_forward_only(s3, tmp_path):
    local = committed_locally(tmp_path / "root", 4, 5)
    store = FsspecStore(s3.url, s3.options)
    for name in ("global_step_4", "global_step_5"):
        store.publish(local / name, name)
    assert store.write_tracker("global_step", 5)
    assert not store.write_tracker("global_step", 4)
    assert store.read_tracker() == 5
    fs = s3.fs()
    assert fs.cat_file(f"{s3.bucket}/run/{L.SKYRL_TRACKER}") == b"5\n"


# ------------------------------------------------------------------ the engine
def test_url_root_saves_prunes_and_resumes_on_a_new_machine(s3, tmp_path):
    with SyncCheckpointEngine(
        s3.url,
        object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "spool1"),
        keep=KeepLast(2),
    ) as eng:
        for step in (10, 20, 30):
            handle = eng.save(step, make_state(step))
        stats = handle.committed_sync(COMMIT_WAIT)
        eng.wait()
    assert stats.remote_path == f"{s3.url}/global_step_30"
    assert stats.uploaded_bytes > 0 and stats.upload_seconds > 0
    assert remote_steps(s3) == [20, 30]
    assert FsspecStore(s3.url, s3.options).read_tracker() == 30
    # The spool keeps only the newest: the store is where checkpoints live.
    assert [c.step for c in L.scan(tmp_path / "spool1", "global_step")] == [30]
    # A new machine: an empty spool, the newest checkpoint fetched from the store.
    state = blank()
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "spool2")
    ) as eng:
        assert eng.load_latest(state) == 30
    assert_same(state, make_state(30))


def test_tiered_each_tier_keeps_its_own(s3, tmp_path):
    tier = RemoteTier(s3.url, keep=KeepEvery(20), storage_options=s3.options)
    root = tmp_path / "fast"
    with SyncCheckpointEngine(root, keep=KeepLast(2), remote=tier) as eng:
        for step in range(10, 70, 10):
            eng.save(step, make_state(step))
        eng.wait()
    assert [c.step for c in L.scan(root, "global_step")] == [50, 60]
    assert remote_steps(s3) == [20, 40, 60]  # every 20th, and the newest
    # The newest good one from either tier: remote 40 is fetched when the local ones are gone.
    import shutil

    for name in ("global_step_50", "global_step_60"):
        shutil.rmtree(root / name)
    FsspecStore(s3.url, s3.options).delete("global_step_60")
    state = blank()
    with SyncCheckpointEngine(root, remote=tier) as eng:
        assert eng.load_latest(state) == 40
    assert_same(state, make_state(40))
    assert (root / "global_step_40" / L.MANIFEST).exists()


def test_corrupt_remote_checkpoint_falls_back_loudly(s3, tmp_path):
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "s1")
    ) as eng:
        eng.save(1, make_state(1))
        eng.save(2, make_state(2))
    fs = s3.fs()
    shard = next(p for p in fs.find(f"{s3.bucket}/run/global_step_2") if p.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[-1] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    state = blank()
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "s2")
    ) as eng:
        with pytest.warns(UserWarning, match="step 2 .* unusable.* download .* removed"):
            assert eng.load_latest(state) == 1
        eng.save(3, make_state(3))  # the run saves on (issue 28 item 5)
    assert_same(state, make_state(1))
    # The store's copy stays (no rename there to quarantine with); the bad download went.
    assert [c.step for c in FsspecStore(s3.url, s3.options).committed("global_step")] == [1, 2, 3]
    assert not (tmp_path / "s2" / "global_step_2").exists()
    assert not (tmp_path / "s2" / L.QUARANTINE_DIR).exists()


def test_plain_dcp_loads_from_the_bucket_without_asyncckpt(s3, tmp_path):
    state = make_state(7)
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "s")
    ) as eng:
        eng.save(7, state)
    torch.save(state["model"], tmp_path / "want.pt")
    code = textwrap.dedent(
        f"""
        import sys, torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        target = {{"model": {{"w": torch.zeros(64, 32), "b": torch.zeros(32)}}}}
        reader = FsspecReader("{s3.url}/global_step_7", **{s3.options!r})
        dcp.load(target, storage_reader=reader, no_dist=True)
        want = torch.load({str(tmp_path / "want.pt")!r})
        assert all(torch.equal(target["model"][k], want[k]) for k in want), "differs"
        assert not any(m.startswith("asyncckpt") for m in sys.modules), "asyncckpt imported"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
    # The public way (README): a URL as checkpoint_id, the store found through AWS_* variables.
    public = (
        code.replace(
            "from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader\n", ""
        )
        .replace(f'reader = FsspecReader("{s3.url}/global_step_7", **{s3.options!r})\n', "")
        .replace("storage_reader=reader", f'checkpoint_id="{s3.url}/global_step_7"')
    )
    assert "FsspecReader" not in public and "checkpoint_id" in public
    out = subprocess.run(
        [sys.executable, "-c", public], capture_output=True, text=True, timeout=120, env=s3.env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_failed_upload_fails_the_save_keeps_the_local_commit_and_is_retried(s3, tmp_path):
    fs = s3.fs()
    url = f"s3://{s3.bucket}-later/run"
    tier = RemoteTier(url, storage_options=s3.options, retries=1)
    root = tmp_path / "fast"
    fs.mkdir(f"{s3.bucket}-later")  # start refuses a missing bucket (probed) ...
    with SyncCheckpointEngine(root, remote=tier) as eng:
        fs.rmdir(f"{s3.bucket}-later")  # ... so it goes away after the start
        handle = eng.save(1, make_state(1))
        with pytest.raises(UploadFailed, match="committed locally") as info:
            handle.committed_sync(COMMIT_WAIT)
        assert "global_step_1" in str(info.value) or "step 1" in str(info.value)
        assert [c.step for c in L.scan(root, "global_step")] == [1]
        fs.mkdir(f"{s3.bucket}-later")
        eng.save(2, make_state(2)).committed_sync(COMMIT_WAIT)
    store = FsspecStore(url, s3.options)
    assert [c.step for c in store.committed("global_step")] == [1, 2]  # 1 caught up
    assert store.check("global_step_1") == [] and store.read_tracker() == 2


def test_a_stalled_upload_times_out_instead_of_hanging(s3, tmp_path):
    tier = RemoteTier(s3.url, storage_options=s3.options, timeout=0.5, retries=2)
    faults.inject("mid_upload", "delay", seconds=3.0)
    with SyncCheckpointEngine(tmp_path / "fast", remote=tier) as eng:
        handle = eng.save(1, make_state(1))
        with pytest.raises(UploadFailed, match=r"no answer within 0.5 s"):
            handle.committed_sync(COMMIT_WAIT)
        faults.clear()
    assert remote_steps(s3) == []


@pytest.mark.parametrize("point", faults.REMOTE_POINTS)
def test_worker_killed_while_publishing_leaves_no_half_checkpoint(s3, tmp_path, point):
    spool = tmp_path / "spool"
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=spool), keep=KeepLast(1)
    ) as eng:
        eng.save(1, make_state(1)).committed_sync(COMMIT_WAIT)
        faults.inject(point, "kill")
        handle = eng.save(2, make_state(2))
        with pytest.raises(UploadFailed, match="IS committed locally"):
            handle.committed_sync(COMMIT_WAIT)
        assert eng.worker_restarts == 1
    store = FsspecStore(s3.url, s3.options)
    committed = [c.step for c in store.committed("global_step")]
    expected = [1] if point in ("mid_upload", "before_marker") else [1, 2]
    if point == "mid_remote_prune":
        expected = [2]  # step 1's marker went first: it is gone, its files are leftovers
    assert committed == expected
    for step in committed:
        assert store.check(L.dir_name("global_step", step)) == []
    # A new machine resumes from the newest checkpoint the store committed, bit for bit...
    state = blank()
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "new")
    ) as eng:  # ...and its start removes the uploads the kill cut short.
        assert eng.load_latest(state) == max(expected)
    assert_same(state, make_state(max(expected)))
    fs = s3.fs()
    names = {p.rstrip("/").split("/")[-1] for p in fs.ls(f"{s3.bucket}/run")}
    assert {n for n in names if L.parse_dir_name("global_step", n) is not None} == {
        L.dir_name("global_step", s) for s in expected
    }


def test_bad_remote_arguments_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="needs a URL"):
        RemoteTier("/local/path")
    with pytest.raises(ValueError, match="retries"):
        RemoteTier("s3://b/run", retries=0)
    with pytest.raises(ValueError, match="already the remote tier"):
        SyncCheckpointEngine("s3://b/run", remote=RemoteTier("s3://b/other"))
    with pytest.raises(ValueError, match="for a URL root"):
        SyncCheckpointEngine(
            tmp_path / "r", object_store=ObjectStore(storage_options={"anon": True})
        )
    assert not (tmp_path / "r").exists()


def test_manifest_json_is_what_the_store_lists(s3, tmp_path):
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "s")
    ) as eng:
        eng.save(3, make_state(3), metrics={"loss": 0.5})
    fs = s3.fs()
    manifest = json.loads(fs.cat_file(f"{s3.bucket}/run/global_step_3/{L.MANIFEST}"))
    assert manifest["step"] == 3 and manifest["metrics"] == {"loss": 0.5}


# ------------------------------------------------------------------ the CLI on a URL
def test_cli_ls_verify_prune_on_a_bucket(s3, tmp_path, capsys):
    from asyncckpt.cli import main

    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "s")
    ) as eng:
        for step in (1, 2, 3):
            eng.save(step, make_state(step), metrics={"loss": 1.0 / step})
    opts = [f"--storage-option=endpoint_url={s3.endpoint}", "--storage-option=key=testing"]
    opts.append("--storage-option=secret=testing")

    def run(*argv: str) -> tuple[int, str]:
        code = main([*argv, s3.url, *opts])
        return code, capsys.readouterr().out

    code, out = run("ls", "--json")
    listed = json.loads(out)
    assert code == 0 and [c["step"] for c in listed["checkpoints"]] == [1, 2, 3]
    assert listed["tracker"] == 3 and {c["status"] for c in listed["checkpoints"]} == {"ok"}
    assert run("verify")[0] == 0
    # A corrupt byte is caught by verify (checksums), not by ls's quick size check.
    fs = s3.fs()
    shard = next(p for p in fs.find(f"{s3.bucket}/run/global_step_2") if p.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[0] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    code, out = run("verify", "--json")
    report = json.loads(out)
    assert code == 1 and [c["ok"] for c in report["checkpoints"]] == [True, False, True]
    code, out = run("prune", "--keep-last", "1", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["would_delete"] == [1, 2] and remote_steps(s3) == [1, 2, 3]
    assert main(["prune", "--keep-best", "1", "--metric", "los", s3.url, *opts]) == 1
    assert "metrics found: loss" in capsys.readouterr().err
    code, out = run("prune", "--keep-last", "1", "--json")
    assert code == 0 and json.loads(out)["deleted"] == [1, 2]
    assert remote_steps(s3) == [3]
    # A wrong bucket is a clear error, exit 1, not a traceback.
    assert main(["ls", f"s3://{s3.bucket}-nope/run", *opts]) == 1


def test_docs_object_storage_snippet_runs_as_written(s3, tmp_path):
    import re
    from pathlib import Path

    readme = (
        Path(__file__).resolve().parents[2] / "docs" / "how-to" / "object-storage.md"
    ).read_text()
    (code, printed) = re.findall(
        r"```python\n(# requires: s3fs.*?)```\n\nprints\n\n```text\n(.*?)```", readme, re.S
    )[0]
    env = {
        **s3.env(),
        "S3_ENDPOINT_URL": s3.endpoint,
        "BUCKET": s3.bucket,
        "ASYNCCKPT_SPOOL": str(tmp_path / "spool"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == printed.replace("my-bucket", s3.bucket)


#: The worker's fault points before its commit on disk: the save fails and commits nothing,
#: and the store never sees step 2; after it (and after the upload): step 2 is in the store.
LOCAL_POINTS = {
    "before_shard_write": [1],
    "mid_shard_write": [1],
    "after_shard_write": [1],
    "before_metadata": [1],
    "before_rename": [1],
    "before_tracker": [1],  # renamed on disk; the trainer finishes it, the upload never ran
    "after_commit": [2],  # published (and step 1 pruned from the store) before the kill
    "mid_prune": [2],
}


def test_every_fault_point_is_covered_on_a_url_root():
    assert set(LOCAL_POINTS) == set(faults.LOCAL_POINTS) - {"after_stage"}  # (the trainer's)


def test_a_point_armed_after_a_save_is_not_fired_by_that_saves_upload(s3, tmp_path):
    """A fault armed after ``save(1)`` is armed for the saves after it. Step 1's upload runs
    beside step 2's write, and the worker arms step 2's points when it starts that write: the
    upload must not fire them. (It did: ``after_commit=kill`` went off after step 1's upload,
    the worker died writing step 2, and the store kept step 1 only. Seen in the integration
    run under load; the slow upload here makes the order certain.)"""
    with SyncCheckpointEngine(
        s3.url,
        object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "spool"),
        keep=KeepLast(1),
    ) as eng:
        faults.inject("mid_upload", "delay", seconds=1.0)  # step 1's upload outlasts 2's start
        first = eng.save(1, make_state(1))
        faults.inject("after_commit", "kill")
        second = eng.save(2, make_state(2))
        first.committed_sync(COMMIT_WAIT)
        second.committed_sync(COMMIT_WAIT)  # the kill comes after step 2 is in the store
        deadline = time.monotonic() + COMMIT_WAIT
        while eng.worker_restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.worker_restarts == 1  # it did fire, once, for the save it was armed for
        faults.clear()
    store = FsspecStore(s3.url, s3.options)
    assert [c.step for c in store.committed("global_step")] == [2]
    assert store.read_tracker() == 2


@pytest.mark.integration
@pytest.mark.parametrize("point", sorted(LOCAL_POINTS))
def test_a_kill_at_every_local_point_of_a_url_root_leaves_the_store_whole(s3, tmp_path, point):
    """The store holds only whole checkpoints whatever the point; a new machine resumes from
    its newest, bit for bit."""
    from asyncckpt import SaveFailed

    with SyncCheckpointEngine(
        s3.url,
        object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "spool"),
        keep=KeepLast(1),
    ) as eng:
        eng.save(1, make_state(1)).committed_sync(COMMIT_WAIT)
        faults.inject(point, "kill")
        handle = eng.save(2, make_state(2))
        try:
            handle.committed_sync(COMMIT_WAIT)
        except SaveFailed:
            pass  # before the commit, or committed on disk but not published: both are said
        deadline = (
            time.monotonic() + COMMIT_WAIT
        )  # after_commit / mid_prune: killed after the handle
        while eng.worker_restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.worker_restarts == 1
    store = FsspecStore(s3.url, s3.options)
    assert [c.step for c in store.committed("global_step")] == LOCAL_POINTS[point]
    for c in store.committed("global_step"):
        assert store.check(c.name) == []
    state = blank()
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "new")
    ) as eng:
        assert eng.load_latest(state) == max(LOCAL_POINTS[point])
    assert_same(state, make_state(max(LOCAL_POINTS[point])))
    assert store.leftovers("global_step") == []


def save_two_ranks_to_a_bucket(rank: int, world: int, url: str, options: dict, spool: str) -> str:
    """A rank's body (tests/test_multirank.run_ranks): two saves of a DTensor state."""
    from test_multirank import make_state as ranked_state

    with SyncCheckpointEngine(
        url,
        object_store=ObjectStore(storage_options=options, spool=spool),
        keep=KeepLast(1),
        distributed=Distributed(timeout=60),
    ) as eng:
        for step in (1, 2):
            stats = eng.save(step, ranked_state(rank, world, step)).committed_sync(120)
    return stats.remote_path


@pytest.mark.integration
def test_two_ranks_commit_once_and_rank0_publishes(s3, tmp_path):
    from test_multirank import ROWS, full_weight, run_ranks

    out = run_ranks(
        save_two_ranks_to_a_bucket, 2, tmp_path, s3.url, s3.options, str(tmp_path / "spool")
    )
    assert out == {r: f"{s3.url}/global_step_2" for r in range(2)}  # every rank's handle
    store = FsspecStore(s3.url, s3.options)
    assert [c.step for c in store.committed("global_step")] == [2]
    manifest = store.read_manifest("global_step_2")
    assert manifest["world_size"] == 2 and store.check("global_step_2") == []
    target = {
        "model": {"w": torch.zeros(ROWS, 3), "bias": torch.zeros(5, dtype=torch.bfloat16)},
        "step": -1,
        "extra": {},
    }
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "new")
    ) as eng:
        assert eng.load_latest(target) == 2  # both ranks' shards, resharded to one process
    assert torch.equal(target["model"]["w"], full_weight(2)) and target["step"] == 2


def test_python_dash_m_ls_reaches_the_bucket_through_the_aws_environment(s3, tmp_path):
    """As a user runs it: no --storage-option, the endpoint and keys from AWS_* variables."""
    from pathlib import Path

    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "s")
    ) as eng:
        eng.save(4, make_state(4))
    env = {**s3.env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "ls", s3.url, "--json"], env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert [c["step"] for c in json.loads(out.stdout)["checkpoints"]] == [4]


# ------------------------------------------------------------------ the spool of a URL root
_OTHER_SERVER = """
import sys
import logging
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.WARNING)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()
server.stop()
"""


def test_two_stores_with_the_same_bucket_and_prefix_never_share_a_spool(s3, tmp_path, monkeypatch):
    """The default spool is keyed by the endpoint too: a fresh server with the same
    s3://bucket/run does not inherit the other one's spooled steps (before, save(1) was refused
    as "older than step 3, committed in <spool>", and a resume found step 3)."""
    from s3server import CREDENTIALS, s3fs

    monkeypatch.setenv("ASYNCCKPT_SPOOL", str(tmp_path / "spools"))
    with SyncCheckpointEngine(s3.url, object_store=ObjectStore(storage_options=s3.options)) as eng:
        for step in (1, 2, 3):
            eng.save(step, make_state(step)).committed_sync(COMMIT_WAIT)
        spool_a = eng.root
    # Another S3 (its own process: moto's servers in one process share their buckets).
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        options = {"endpoint_url": other.stdout.readline().strip(), **CREDENTIALS}
        assert options["endpoint_url"].startswith("http://127.0.0.1:")
        assert options["endpoint_url"] != s3.endpoint
        s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(s3.bucket)
        with SyncCheckpointEngine(s3.url, object_store=ObjectStore(storage_options=options)) as eng:
            assert eng.root != spool_a
            assert eng.load_latest(blank()) is None  # the new store holds nothing
            eng.save(1, make_state(1)).committed_sync(COMMIT_WAIT)
        assert [c.step for c in FsspecStore(s3.url, options).committed("global_step")] == [1]
    finally:
        other.stdin.close()  # the server exits when its stdin closes
        other.wait(30)
    assert remote_steps(s3) == [1, 2, 3]  # untouched by the other store's run
    assert [c.step for c in L.scan(spool_a, "global_step")] == [3]


def test_the_spool_is_reconciled_with_its_store_at_start(s3, tmp_path):
    """At start the store says what exists: a spooled step it lost (wiped, replaced at the
    same address) is moved aside; one waiting to be uploaded (its upload failed) stays, is
    resumed from and uploaded by the next save; a spool shared with another store counts for
    nothing there."""
    spool = tmp_path / "spool"
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=spool)
    ) as eng:
        eng.save(1, make_state(1)).committed_sync(COMMIT_WAIT)
        eng.save(2, make_state(2)).committed_sync(COMMIT_WAIT)
        faults.inject("before_marker", "raise")
        with pytest.raises(UploadFailed, match="committed locally"):
            eng.save(3, make_state(3)).committed_sync(COMMIT_WAIT)
    assert [c.step for c in L.scan(spool, "global_step")] == [2, 3]  # a failed save prunes nothing
    assert remote_steps(s3) == [1, 2]
    s3.fs().rm(f"{s3.bucket}/run", recursive=True)  # the store loses everything
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=spool)
    ) as eng:
        # Step 2 was published and the store no longer has it: aside, not used.
        assert [c.step for c in L.scan(spool, "global_step")] == [3]
        aside = [n for n in os.listdir(spool) if n.startswith(".orphaned-")]
        assert len(aside) == 1 and "global_step_2" in aside[0]
        state = blank()
        assert eng.load_latest(state) == 3  # pending: the trainer was told it committed here
        assert_same(state, make_state(3))
        eng.save(4, make_state(4)).committed_sync(COMMIT_WAIT)
    assert remote_steps(s3) == [3, 4]  # 3 caught up; 2 was not re-uploaded
    # Another store (another prefix) with the same spool= directory: nothing of it counts.
    other = f"{s3.url}-other"
    with SyncCheckpointEngine(
        other, object_store=ObjectStore(storage_options=s3.options, spool=spool)
    ) as eng:
        assert L.scan(spool, "global_step") == []
        assert eng.load_latest(blank()) is None
        eng.save(1, make_state(1)).committed_sync(COMMIT_WAIT)
    assert [c.step for c in FsspecStore(other, s3.options).committed("global_step")] == [1]
    assert remote_steps(s3) == [3, 4]


def test_a_missing_bucket_is_refused_at_start_in_one_line(s3, tmp_path, capfd):
    from asyncckpt.errors import CheckpointError

    missing = f"s3://{s3.bucket}-missing/run"
    # A URL root, and a local root with a remote tier: refused when the engine starts, not
    # after two steps have committed to the spool.
    for kwargs in (
        {
            "root": missing,
            "object_store": ObjectStore(storage_options=s3.options, spool=tmp_path / "spool"),
        },
        {"root": tmp_path / "local", "remote": RemoteTier(missing, storage_options=s3.options)},
    ):
        root = kwargs.pop("root")
        with pytest.raises(CheckpointError) as info:
            with SyncCheckpointEngine(root, **kwargs):
                pytest.fail("the engine started on a missing bucket")
        msg = str(info.value)
        assert "\n" not in msg and missing in msg and "does not exist" in msg, msg
    assert not (tmp_path / "spool").exists() and not (tmp_path / "local").exists()
    assert "Traceback" not in capfd.readouterr().err
    # The probe of a good bucket leaves nothing behind.
    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "good")
    ):
        pass
    assert s3.fs().find(s3.bucket) == []


def test_every_cli_subcommand_takes_a_url(s3, tmp_path, capsys):
    import argparse

    from asyncckpt.cli import build_parser, main

    with SyncCheckpointEngine(
        s3.url, object_store=ObjectStore(storage_options=s3.options, spool=tmp_path / "s")
    ) as eng:
        for step in (1, 2):
            eng.save(step, make_state(step), metrics={"loss": 1.0 / step})
    opts = [f"--storage-option=endpoint_url={s3.endpoint}", "--storage-option=key=testing"]
    opts.append("--storage-option=secret=testing")
    extra = {"prune": ["--keep-last", "5", "--dry-run"]}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    # a new one is tested here too; start-fresh takes local roots only (an object store
    # has no quarantine to settle: the engine never moves a checkpoint there)
    assert set(sub.choices) == {"ls", "verify", "prune", "stats", "start-fresh"}
    for command in sorted(set(sub.choices) - {"start-fresh"}):
        code = main([command, "--json", *extra.get(command, []), s3.url, *opts])
        captured = capsys.readouterr()
        assert code == 0, (command, captured.err)
        json.loads(captured.out)
    code = main(["stats", "--json", s3.url, *opts])
    records = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["bytes"] > 0 and r["write_seconds"] is not None for r in records)
    assert records[1]["path"] == f"{s3.url}/global_step_2"
    assert main(["stats", f"s3://{s3.bucket}-nope/run", *opts]) == 1


def test_ls_shows_the_uploads_a_remote_tier_has_not_published(s3, tmp_path, capsys):
    """Committed locally, not yet in the store (an upload under way, then one cut by the
    worker's death): `ls` of the local root lists it as pending; the next save publishes it."""
    import signal

    from asyncckpt.cli import main

    def ls() -> dict:
        assert main(["ls", "--json", str(root)]) == 0
        return json.loads(capsys.readouterr().out)

    root = tmp_path / "local"
    tier = RemoteTier(s3.url, storage_options=s3.options)
    with SyncCheckpointEngine(
        root, remote=tier, throttle=ThrottleConfig.background(write_timeout=20)
    ) as eng:
        eng.save(1, make_state(1)).committed_sync(COMMIT_WAIT)
        assert ls()["uploads_pending"] == {"url": s3.url, "steps": []}
        faults.inject("mid_upload", "hang")
        handle = eng.save(2, make_state(2))
        deadline = time.monotonic() + 60
        while not (root / L.dir_name("global_step", 2)).is_dir():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ls()["uploads_pending"] == {"url": s3.url, "steps": [2]}
        assert main(["ls", str(root)]) == 0
        assert f"upload pending to {s3.url}: step 2" in capsys.readouterr().out
        faults.clear()
        os.kill(eng.worker_pid, signal.SIGKILL)
        with pytest.raises(UploadFailed):
            handle.committed_sync(COMMIT_WAIT)
        assert ls()["uploads_pending"]["steps"] == [2]  # still to do: the next save does it
        eng.save(3, make_state(3)).committed_sync(COMMIT_WAIT)
        assert ls()["uploads_pending"]["steps"] == []
    assert remote_steps(s3) == [1, 2, 3]
