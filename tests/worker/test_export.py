"""Hugging Face safetensors export of committed checkpoints (``asyncckpt.worker.export``).

A tiny GPT-2 (built from a config, nothing downloaded) is saved by the real engine in each
format that export reads (dcp, torch_dist, components with a dcp and a pt part), exported, and
read back three ways: ``safetensors.torch.load_file`` bit for bit, the index's weight map for a
sharded export, and ``transformers.AutoModelForCausalLM.from_pretrained`` with equal weights
and logits. A checkpoint written by two ranks (a DTensor sharded over them) is consolidated
into full tensors without a process group. Corruption, bad inputs, replacement, a crash while
writing and pruning are checked on disk.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncckpt import Component, Distributed, SyncCheckpointEngine
from asyncckpt.core import layout as L
from asyncckpt.errors import CorruptCheckpoint
from asyncckpt.storage.manifest import check_dir, read_manifest
from asyncckpt.worker.export import (
    INDEX_NAME,
    WEIGHTS_NAME,
    HFExport,
    UnknownComponent,
    export_dir,
    export_step,
    exports_to_delete,
    parse_size,
    prune_exports,
    read_full_state,
    write_safetensors,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

STEP = 5
COMPONENTS = {
    "policy": {"model": "dcp", "optimizer": Component("pt")},
    "ref": Component("pt", path="ref/ref.pt"),
    "data": Component("pt", path="data.pt"),
}


# ------------------------------------------------------------------------------ fixtures


def _config() -> Any:
    return transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def gpt2() -> Any:
    """A trained-one-step tiny GPT-2 and its optimizer (state that is not the init)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    opt.step()
    model.eval()
    return model, opt


@pytest.fixture(scope="module")
def roots(gpt2: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One committed step per format, saved by the real engine (read-only for the tests)."""
    model, opt = gpt2
    sd = model.state_dict()
    base = tmp_path_factory.mktemp("ckpt")
    out = {}
    for fmt in ("dcp", "torch_dist"):
        with SyncCheckpointEngine(base / fmt, format=fmt) as engine:
            engine.save(STEP, {"model": sd, "optimizer": opt.state_dict(), "step": STEP})
            engine.wait()
        out[fmt] = base / fmt
    ref = {"model": {**sd, "ids": torch.arange(7)}, "epoch": 3}  # pt: tied weights shared
    with SyncCheckpointEngine(base / "components", components=COMPONENTS) as engine:
        engine.save(
            STEP,
            {
                "policy": {"model": sd, "optimizer": opt.state_dict()},
                "ref": ref,
                "data": {"seen": 10},
            },
        )
        engine.wait()
    out["components"] = base / "components"
    return out


def step_dir(root: Path) -> Path:
    return root / L.dir_name("global_step", STEP)


def copy_root(root: Path, tmp_path: Path) -> Path:
    """A private copy of a fixture root, for tests that damage it."""
    dst = tmp_path / "ckpt"
    shutil.copytree(root, dst, symlinks=True)
    return dst


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for k, w in want.items():
        g = got[k]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), (k, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(bits(g), bits(w)), k


def load_export(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, through the index's weight map when there is one."""
    index = out / INDEX_NAME
    if not index.exists():
        return safetensors_torch.load_file(out / WEIGHTS_NAME)
    weight_map = json.loads(index.read_text())["weight_map"]
    got: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        part = safetensors_torch.load_file(out / file)
        assert {k for k, f in weight_map.items() if f == file} == set(part), file
        got.update(part)
    return got


def assert_loads_in_transformers(out: Path, model: Any) -> None:
    model.config.save_pretrained(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    loaded.eval()
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("fmt", ["dcp", "torch_dist"])
def test_a_gpt2_exports_bit_for_bit_and_loads_in_transformers(
    fmt: str, gpt2: Any, roots: dict[str, Path], tmp_path: Path
) -> None:
    model, _ = gpt2
    export = HFExport(every_steps=5, path=tmp_path / "hf")
    out = export_step(export, step_dir(roots[fmt]), STEP)
    assert out == tmp_path / "hf" / "global_step_5" / "model" == export_dir(export, STEP)
    # Everything fits one file: no index, as transformers writes it.
    assert sorted(os.listdir(out)) == [L.MANIFEST, WEIGHTS_NAME]
    with safetensors_torch.safe_open(out / WEIGHTS_NAME, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # Every name of the saved state dict, the tied lm_head included; no optimizer state.
    assert_bit_equal(load_export(out), model.state_dict())
    manifest = read_manifest(out)
    assert manifest["format"] == "hf_safetensors" and manifest["step"] == STEP
    assert manifest["component"] == "model" and check_dir(out) == []
    assert not [n for n in os.listdir(out.parent) if L.is_leftover(n)]
    assert_loads_in_transformers(out, model)


def test_components_dcp_and_pt_parts(gpt2: Any, roots: dict[str, Path], tmp_path: Path) -> None:
    model, _ = gpt2
    sd = model.state_dict()
    sdir = step_dir(roots["components"])
    # A dcp group member, named by its dotted name; SkyRL's directory name.
    export = HFExport(1, tmp_path / "hf", component="policy.model", dirname="policy")
    out = export_step(export, sdir, STEP)
    assert out == tmp_path / "hf" / "global_step_5" / "policy"
    assert_bit_equal(load_export(out), sd)
    # A sub-dict of a pt component; "epoch" (not a tensor) is not under it, the int "ids" is.
    got = read_full_state(sdir, "ref.model")
    assert_bit_equal(got, {**sd, "ids": torch.arange(7)})
    out = export_step(HFExport(1, tmp_path / "hf", component="ref.model"), sdir, STEP)
    assert out == tmp_path / "hf" / "global_step_5" / "ref" / "model"
    assert_bit_equal(load_export(out), {**sd, "ids": torch.arange(7)})
    # Non-tensor leaves are skipped: the whole pt component holds "epoch" too.
    assert set(read_full_state(sdir, "ref")) == {f"model.{k}" for k in sd} | {"model.ids"}


def test_dtype_casts_floating_tensors_only(
    gpt2: Any, roots: dict[str, Path], tmp_path: Path
) -> None:
    model, _ = gpt2
    sd = model.state_dict()
    export = HFExport(1, tmp_path / "hf", component="ref.model", dtype=torch.bfloat16)
    out = export_step(export, step_dir(roots["components"]), STEP)
    want = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    assert_bit_equal(load_export(out), {**want, "ids": torch.arange(7)})
    assert read_manifest(out)["dtype"] == "torch.bfloat16"


def test_sharded_export_matches_the_index_and_loads_in_transformers(
    gpt2: Any, roots: dict[str, Path], tmp_path: Path
) -> None:
    model, _ = gpt2
    sd = model.state_dict()
    limit = "60KB"
    out = export_step(HFExport(1, tmp_path / "hf", max_shard_size=limit), step_dir(roots["dcp"]), 5)
    index = json.loads((out / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(out)) == sorted([*files, INDEX_NAME, L.MANIFEST])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())
    for file in files:
        # A file goes over the limit only when one tensor alone is larger.
        data = safetensors_torch.load_file(out / file)
        size = sum(t.nbytes for t in data.values())
        assert size <= parse_size(limit) or len(data) == 1, (file, size)
    assert_bit_equal(load_export(out), sd)
    # The same split as huggingface_hub gives the saved state dict (its order, no sharing).
    from huggingface_hub import split_torch_state_dict_into_shards

    unshared = {k: v.clone() for k, v in read_full_state(step_dir(roots["dcp"]), "model").items()}
    split = split_torch_state_dict_into_shards(unshared, max_shard_size=limit)
    assert split.tensor_to_filename == index["weight_map"]
    assert_loads_in_transformers(out, model)


# ------------------------------------------------------------------------------ two ranks

ROWS = 6


def _rank_entry(rank: int, world: int, store_path: str, root: str, results: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4)
        w = DTensor.from_local(full.chunk(world)[rank].clone(), mesh, [Shard(0)], run_check=False)
        state = {
            "model": {"w": w, "b": torch.full((3,), 2.5, dtype=torch.bfloat16)},
            "optimizer": {"m": DTensor.from_local(torch.ones(ROWS // world, 4), mesh, [Shard(0)])},
            "step": STEP,
        }
        with SyncCheckpointEngine(root, distributed=Distributed(timeout=60)) as engine:
            engine.save(STEP, state).committed_sync(timeout=120)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, traceback.format_exc()))


@pytest.mark.integration
def test_two_ranks_shards_are_consolidated_without_a_process_group(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    root = tmp_path / "ckpt"
    store = str(tmp_path / "store")
    procs = [
        ctx.Process(target=_rank_entry, args=(r, 2, store, str(root), results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    errors = []
    try:
        for _ in procs:
            rank, error = results.get(timeout=120)
            if error:
                errors.append(f"rank {rank}:\n{error}")
    except queue.Empty:
        errors.append("the ranks did not finish in time")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    sdir = step_dir(root)
    # Each rank wrote its own shard of w: the export must assemble both.
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(sdir))
    assert not torch.distributed.is_initialized()
    out = export_step(HFExport(1, tmp_path / "hf"), sdir, STEP)
    full = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4)
    assert_bit_equal(
        load_export(out), {"w": full, "b": torch.full((3,), 2.5, dtype=torch.bfloat16)}
    )


# ------------------------------------------------------------------------------ damage


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata"])
def test_a_corrupt_source_fails_loudly_and_exports_nothing(
    victim: str, roots: dict[str, Path], tmp_path: Path
) -> None:
    root = copy_root(roots["dcp"], tmp_path)
    path = step_dir(root) / victim
    _flip_byte(path, path.stat().st_size // 2)
    export = HFExport(1, tmp_path / "hf")
    with pytest.raises(CorruptCheckpoint, match=f"{victim}: checksum mismatch"):
        export_step(export, step_dir(root), STEP)
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        read_full_state(step_dir(root), "model")
    assert not (tmp_path / "hf").exists()


def test_only_the_files_of_the_component_are_read(
    gpt2: Any, roots: dict[str, Path], tmp_path: Path
) -> None:
    root = copy_root(roots["components"], tmp_path)
    sdir = step_dir(root)
    # The optimizer's file is damaged: the model exports all the same; the model's is not.
    _flip_byte(sdir / "policy" / "optimizer", 100)
    got = read_full_state(sdir, "policy.model")
    assert_bit_equal(got, gpt2[0].state_dict())
    with pytest.raises(CorruptCheckpoint, match="policy/optimizer: checksum mismatch"):
        read_full_state(sdir, "policy.optimizer")
    os.truncate(sdir / "policy" / "model" / "__0_0.distcp", 1000)
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        export_step(HFExport(1, tmp_path / "hf", component="policy.model"), sdir, STEP)
    assert not (tmp_path / "hf").exists()


def test_an_export_inside_the_checkpoint_is_refused(roots: dict[str, Path]) -> None:
    # The export root is the checkpoint root: step 5's export would land in global_step_5.
    root = roots["dcp"]
    before = sorted(os.listdir(step_dir(root)))
    with pytest.raises(ValueError, match="inside the checkpoint"):
        export_step(HFExport(1, root), step_dir(root), STEP)
    assert sorted(os.listdir(step_dir(root))) == before


def test_a_step_without_manifest_is_refused(roots: dict[str, Path], tmp_path: Path) -> None:
    root = copy_root(roots["dcp"], tmp_path)
    (step_dir(root) / L.MANIFEST).unlink()
    with pytest.raises(CorruptCheckpoint, match="no asyncckpt_manifest.json"):
        export_step(HFExport(1, tmp_path / "hf"), step_dir(root), STEP)
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------ bad inputs


def test_unknown_components_name_what_there_is(roots: dict[str, Path]) -> None:
    with pytest.raises(UnknownComponent, match=r"keys at the top level: \['model', 'optimizer'"):
        read_full_state(step_dir(roots["dcp"]), "policy")
    with pytest.raises(KeyError, match=r"keys under 'model': \['lm_head', 'transformer'\]"):
        read_full_state(step_dir(roots["torch_dist"]), "model.decoder")
    comp = step_dir(roots["components"])
    with pytest.raises(
        KeyError, match=r"its components: \['data', 'policy.model', 'policy.optimizer', 'ref'\]"
    ):
        read_full_state(comp, "critic.model")
    with pytest.raises(ValueError, match="is a group of components"):
        read_full_state(comp, "policy")
    with pytest.raises(ValueError, match="a single value"):
        read_full_state(step_dir(roots["dcp"]), "model.lm_head.weight")
    with pytest.raises(ValueError, match="a single value"):
        read_full_state(step_dir(roots["dcp"]), "step")  # not a tensor
    with pytest.raises(ValueError, match="a single value"):
        read_full_state(comp, "data.seen")  # in a pt file
    with pytest.raises(ValueError, match="holds no tensors"):
        read_full_state(comp, "data")


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"every_steps": 0}, "every_steps must be >= 1"),
        ({"every_steps": -3}, "every_steps must be >= 1"),
        ({"keep": 0}, "keep must be an int >= 1 or None"),
        ({"component": ""}, "component must be a non-empty"),
        ({"component": "policy..model"}, "no empty segments"),
        ({"component": "a/b"}, "no '/'"),
        ({"dirname": "../up"}, "plain relative path"),
        ({"dirname": "/abs"}, "plain relative path"),
        ({"max_shard_size": "5 parsecs"}, "max_shard_size '5 parsecs' is not a size"),
        ({"max_shard_size": "GB"}, "max_shard_size 'GB' is not a size"),
        ({"max_shard_size": 0}, "at least 1 byte"),
        ({"path": "s3://bucket/exports"}, "object storage"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, error: str, tmp_path: Path) -> None:
    args = {"every_steps": 1, "path": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=error):
        HFExport(**args)


def test_sizes_and_due() -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    assert parse_size(1234) == 1234
    assert parse_size("1GiB") == 2**30 and parse_size("512 MiB") == 512 * 2**20
    for s in ("500MB", "5GB", "1.5GB", "20KB", "1TB", "5gb"):
        assert parse_size(s) == parse_size_to_int(s), s  # decimal, as HF reads it
    export = HFExport(every_steps=10, path="exports")
    assert export.max_shard_bytes == 5 * 10**9
    assert [s for s in range(35) if export.due(s)] == [0, 10, 20, 30]


# ------------------------------------------------------------------------------ writing


def test_tied_and_viewed_tensors_are_written_whole(tmp_path: Path) -> None:
    base = torch.randn(8, 4)
    tensors = {
        "emb": base,
        "head": base,  # tied: one storage
        "row": base[2],  # a view into it
        "t": base.t(),  # not contiguous
        "empty": torch.empty(0, 3),
    }
    index = write_safetensors(tensors, tmp_path / "out", 10**6, {"note": "x"})
    got = load_export(tmp_path / "out")
    assert_bit_equal(got, {k: v.contiguous() for k, v in tensors.items()})
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert set(index["weight_map"].values()) == {WEIGHTS_NAME}
    with safetensors_torch.safe_open(tmp_path / "out" / WEIGHTS_NAME, "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}


def test_an_export_of_the_same_step_is_replaced(tmp_path: Path) -> None:
    out = tmp_path / "hf" / "global_step_3" / "model"
    write_safetensors({"a": torch.zeros(64), "b": torch.zeros(64)}, out, 300, step=3)
    assert len(os.listdir(out)) == 4  # two files, the index, the manifest
    write_safetensors({"a": torch.ones(2)}, out, 300, step=3)
    assert sorted(os.listdir(out)) == [L.MANIFEST, WEIGHTS_NAME]
    assert_bit_equal(load_export(out), {"a": torch.ones(2)})
    assert os.listdir(out.parent) == ["model"]  # no temporary, no trash
    assert check_dir(out) == []


def test_a_crash_while_writing_leaves_the_old_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "global_step_1" / "model"
    write_safetensors({"a": torch.zeros(4)}, out, 100)
    real = safetensors_torch.save_file
    calls = []

    def fail_second(tensors: Any, path: str, metadata: Any = None) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors_torch, "save_file", fail_second)
    with pytest.raises(OSError, match="No space left"):
        write_safetensors({"a": torch.ones(64), "b": torch.ones(64)}, out, 300)
    assert len(calls) == 2
    assert os.listdir(out.parent) == ["model"]
    assert_bit_equal(load_export(out), {"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="no tensors"):
        write_safetensors({}, tmp_path / "empty", 100)
    assert not (tmp_path / "empty").exists()


def test_a_failed_publish_puts_the_replaced_export_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """commit.publish_replacing: the old export is retired, the rename of the new one fails:
    the old one is renamed back, the new temporary removed (never no export, never a mix)."""
    from asyncckpt.storage import localfs

    out = tmp_path / "global_step_1" / "model"
    write_safetensors({"a": torch.zeros(4)}, out, 100, step=1)

    def refuse(src: Any, dst: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(localfs, "rename_new", refuse)
    with pytest.raises(OSError, match="Input/output"):
        write_safetensors({"a": torch.ones(4)}, out, 100, step=1)
    assert os.listdir(out.parent) == ["model"]  # no temporary, no trash
    assert_bit_equal(load_export(out), {"a": torch.zeros(4)})
    assert check_dir(out) == []


def test_prune_removes_the_leftover_of_a_crashed_export_with_a_dash_in_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary is named by layout.tmp_name_of ("-" as "_"); the pruner finds it."""
    from asyncckpt.worker import export as E

    root = tmp_path / "hf"
    export = HFExport(1, root, keep=1, dirname="my-model")
    write_safetensors({"w": torch.ones(2)}, export_dir(export, 1), 100)
    # A crash: the lock goes with the process, the temporary stays.
    monkeypatch.setattr(E._Staged, "abort", lambda self: self.close())

    def fail(tensors: Any, path: str, metadata: Any = None) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_torch, "save_file", fail)
    with pytest.raises(OSError, match="No space left"):
        write_safetensors({"w": torch.zeros(2)}, export_dir(export, 1), 100)
    monkeypatch.undo()
    [leftover] = [n for n in os.listdir(root / "global_step_1") if n != "my-model"]
    assert leftover.startswith(".tmp-my_model-")
    prune_exports(export)
    assert os.listdir(root / "global_step_1") == ["my-model"]


# ------------------------------------------------------------------------------ pruning


def test_exports_to_delete() -> None:
    assert exports_to_delete([5, 1, 3, 9], 2) == {1, 3}
    assert exports_to_delete([5, 1, 3], 3) == set()
    assert exports_to_delete([5, 1, 3], 10) == set()
    assert exports_to_delete([5, 1, 3], None) == set()
    assert exports_to_delete([], 1) == set()
    assert exports_to_delete([4, 4, 2], 1) == {2}
    with pytest.raises(ValueError, match="keep"):
        exports_to_delete([1], 0)


def test_prune_keeps_the_newest_and_touches_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "hf"
    export = HFExport(1, root, keep=2)
    for step in (1, 2, 3, 4, 5):
        write_safetensors({"w": torch.full((2,), float(step))}, export_dir(export, step), 100)
    # Not this export's: other files, another component's export, a half-made directory.
    (root / "notes.txt").write_text("keep me")
    write_safetensors({"v": torch.ones(1)}, root / "global_step_2" / "critic", 100)
    (root / "global_step_1" / "model-old").mkdir()
    (root / "global_step_0" / "model").mkdir(parents=True)  # no manifest: not an export
    # A link named like a step, to an export outside the root: never followed nor deleted.
    outside = tmp_path / "outside"
    write_safetensors({"w": torch.zeros(1)}, outside / "model", 100)
    (root / "global_step_0x").mkdir()
    os.symlink(outside, root / "global_step_9")
    # Leftovers: a crashed temporary and trash are removed; a temporary of an export in
    # flight (locked) is not, nor one of an export named "model-x".
    crashed = root / "global_step_6" / ".tmp-model-0123456789ab"
    crashed.mkdir(parents=True)
    (crashed / "model.safetensors").write_bytes(b"half")
    trash = root / "global_step_3" / ".trash-model-aaaaaaaaaaaa"
    trash.mkdir()
    in_flight = root / "global_step_7" / ".tmp-model-bbbbbbbbbbbb"
    in_flight.mkdir(parents=True)
    other = root / "global_step_7" / ".tmp-model-x-cccccccccccc"
    other.mkdir()
    fd = os.open(in_flight, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        removed = prune_exports(export)
    finally:
        os.close(fd)
    assert sorted(removed) == [export_dir(export, s) for s in (1, 2, 3)]
    assert [s for s in range(10) if export_dir(export, s).exists()] == [0, 4, 5, 9]
    assert_bit_equal(load_export(export_dir(export, 5)), {"w": torch.full((2,), 5.0)})
    assert (root / "notes.txt").read_text() == "keep me"
    assert os.listdir(root / "global_step_2") == ["critic"]
    assert os.listdir(root / "global_step_1") == ["model-old"]
    assert not (root / "global_step_3").exists()  # emptied, so removed
    assert (root / "global_step_9").is_symlink() and check_dir(outside / "model") == []
    assert not crashed.exists() and not trash.exists()
    assert in_flight.is_dir() and other.is_dir()
    # Nothing more to do; without keep, nothing is deleted.
    assert prune_exports(export) == []
    assert prune_exports(HFExport(1, root)) == []
    assert prune_exports(HFExport(1, tmp_path / "missing", keep=1)) == []


def test_prune_never_leaves_only_a_corrupt_export(tmp_path: Path) -> None:
    """The export's retention is the one pruner's (issue 23): the newest export failing its
    manifest, the newest one that verifies is kept too (it used to be deleted, leaving only
    the corrupt one); the export just written is trusted, not read back."""
    root = tmp_path / "hf"
    export = HFExport(1, root, keep=1)
    for step in (1, 2, 3):
        write_safetensors({"w": torch.full((64,), float(step))}, export_dir(export, step), 10**6)
    shard = export_dir(export, 3) / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert prune_exports(export) == [export_dir(export, 1)]
    assert [s for s in (1, 2, 3) if export_dir(export, s).exists()] == [2, 3]
    # Trusted as just written (checksummed as it was): nothing read, the rest goes.
    assert prune_exports(export, just_exported=3) == [export_dir(export, 2)]


# ------------------------------------------------------------------------ through the engine


def test_engine_exports_every_n_steps_in_the_worker_with_its_own_retention(
    gpt2: Any, tmp_path: Path
) -> None:
    model, opt = gpt2
    sd = model.state_dict()
    export = HFExport(
        every_steps=2, path=tmp_path / "hf", component="policy.model", dirname="policy", keep=2
    )
    with SyncCheckpointEngine(
        tmp_path / "ckpt",
        components={"policy": {"model": "dcp", "optimizer": Component("pt")}},
        export=export,
    ) as engine:
        handles = {
            step: engine.save(step, {"policy": {"model": sd, "optimizer": opt.state_dict()}})
            for step in range(1, 7)
        }
        engine.wait()
    stats = {step: h.committed_sync(0) for step, h in handles.items()}
    assert [s for s in stats if stats[s].export_path] == [2, 4, 6]
    assert stats[1].export_seconds == 0 and stats[6].export_seconds > 0
    # SkyRL's layout, the newest two kept.
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["global_step_4", "global_step_6"]
    out = tmp_path / "hf" / "global_step_6" / "policy"
    assert stats[6].export_path == str(out)
    assert_bit_equal(load_export(out), sd)
    assert check_dir(out) == []
    assert_loads_in_transformers(out, model)


def test_engine_refuses_an_export_of_a_missing_component_before_saving(
    gpt2: Any, tmp_path: Path
) -> None:
    model, _ = gpt2
    export = HFExport(every_steps=1, path=tmp_path / "hf", component="modle")
    with SyncCheckpointEngine(tmp_path / "ckpt", export=export) as engine:
        with pytest.raises(ValueError, match=r"no key 'modle' \(it has \['model', 'step'\]\)"):
            engine.save(1, {"model": model.state_dict(), "step": 1})
    assert L.scan(tmp_path / "ckpt", "global_step") == []
    assert not (tmp_path / "hf").exists()


def test_engine_export_failure_says_the_step_is_committed(gpt2: Any, tmp_path: Path) -> None:
    from asyncckpt import ExportFailed

    model, _ = gpt2
    blocker = tmp_path / "hf"
    blocker.write_text("a file where the export root should be")
    export = HFExport(every_steps=1, path=blocker, component="model")
    with SyncCheckpointEngine(tmp_path / "ckpt", export=export) as engine:
        handle = engine.save(1, {"model": model.state_dict()})
        with pytest.raises(ExportFailed, match="IS committed"):
            handle.committed_sync(60)
    assert [c.step for c in L.scan(tmp_path / "ckpt", "global_step")] == [1]


def test_docs_export_snippet_runs_as_written(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    blocks = re.findall(
        r"```python\n(# requires: safetensors.*?)```",
        (repo / "docs" / "how-to" / "hf-export.md").read_text(),
        re.S,
    )
    assert len(blocks) == 1
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run(
        [sys.executable, "-c", blocks[0]], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("loads in transformers: True"), out.stdout
    assert sorted(p.name for p in (tmp_path / "hf-exports").iterdir()) == [
        "global_step_4",
        "global_step_6",
    ]


# ------------------------------------------------------------- killed in the middle of one


def _small_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 64, generator=g),
        "b.weight": torch.randn(64, 64, generator=g),
    }


def test_worker_killed_mid_export_fails_the_handle_and_the_next_worker_exports(
    tmp_path: Path,
) -> None:
    """Before: the handle said committed, no ExportFailed, and the export never appeared."""
    from asyncckpt import ExportFailed, faults

    export = HFExport(
        every_steps=2, path=tmp_path / "hf", component="policy.model", max_shard_size=20000
    )
    with SyncCheckpointEngine(tmp_path / "ckpt", export=export) as engine:
        faults.inject("mid_export", "kill")  # after the first of its two files
        handle = engine.save(2, {"policy": {"model": _small_model(2)}})
        with pytest.raises(ExportFailed, match="IS committed") as info:
            handle.committed_sync(120)
        assert "before its Hugging Face export" in str(info.value)
        assert engine.worker_restarts == 1
        # The new worker exports step 2 before it takes the next job.
        engine.save(3, {"policy": {"model": _small_model(3)}}).committed_sync(120)
    assert [c.step for c in L.scan(tmp_path / "ckpt", "global_step")] == [2, 3]
    out = export_dir(export, 2)
    assert_bit_equal(load_export(out), _small_model(2))
    assert check_dir(out) == [] and read_manifest(out)["step"] == 2
    assert os.listdir(tmp_path / "hf") == ["global_step_2"]  # no temporary left
    assert os.listdir(tmp_path / "hf" / "global_step_2") == ["policy"]


_TRAINER = """
import sys, torch
from asyncckpt import SyncCheckpointEngine, ThrottleConfig
from asyncckpt.worker.export import HFExport
sys.path.insert(0, {tests!r})
from test_export import _small_model
export = HFExport(every_steps=2, path={hf!r}, component="policy.model", max_shard_size=20000)
# write_timeout bounds the orphaned worker, hung in the export, once the trainer is killed.
with SyncCheckpointEngine({ckpt!r}, export=export, throttle=ThrottleConfig.background(write_timeout=5)) as engine:
    engine.save(2, {{"policy": {{"model": _small_model(2)}}}})
    print("saved", flush=True)
    engine.wait()
"""


def test_trainer_killed_mid_export_leaves_nothing_visible_and_the_next_start_exports(
    tmp_path: Path,
) -> None:
    """Before: an empty global_step_2/policy/ stayed in the export root for good (a watcher of
    SkyRL's {export_path}/global_step_N/policy/ took it for an export)."""
    import signal
    import subprocess
    import sys
    import time

    hf, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    code = _TRAINER.format(tests=str(Path(__file__).parent), hf=str(hf), ckpt=str(ckpt))
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "ASYNCCKPT_FAULTS": "mid_export=hang"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        # The worker hangs after the first file of step 2's export: its temporary is there.
        while not any(p.name.startswith(L.TMP_PREFIX) for p in hf.rglob("*")):
            assert proc.poll() is None and time.monotonic() < deadline, "never reached the export"
            time.sleep(0.05)
        # Nothing a watcher would take for an export: the whole step directory is staged.
        assert [n[:19] for n in os.listdir(hf)] == [".tmp-global_step_2-"]
        assert L.scan(ckpt, "global_step")[0].step == 2  # committed before the export
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    export = HFExport(every_steps=2, path=hf, component="policy.model", max_shard_size=20000)
    # The orphaned worker gives up at write_timeout; the next engine waits for it, then
    # exports step 2.
    with SyncCheckpointEngine(ckpt, export=export) as engine:
        engine.save(3, {"policy": {"model": _small_model(3)}}).committed_sync(120)
    assert os.listdir(hf) == ["global_step_2"]  # the leftover temporary removed
    assert_bit_equal(load_export(export_dir(export, 2)), _small_model(2))
    assert check_dir(export_dir(export, 2)) == []


def test_prune_removes_staged_leftovers_and_empty_directories_of_interrupted_exports(
    tmp_path: Path,
) -> None:
    root = tmp_path / "hf"
    export = HFExport(1, root, component="policy.model")  # exports at global_step_N/policy/model
    write_safetensors({"w": torch.ones(2)}, export_dir(export, 1), 100)
    crashed_step = root / ".tmp-global_step_2-0123456789ab" / "policy" / "model"
    crashed_step.mkdir(parents=True)
    (root / "global_step_3" / ".tmp-policy-0123456789ab").mkdir(parents=True)
    (root / "global_step_4" / "policy").mkdir(parents=True)  # an older version's leftover
    (root / "global_step_5" / "policy").mkdir(parents=True)
    (root / "global_step_5" / "policy" / "notes.txt").write_text("not ours")
    in_flight = root / ".tmp-global_step_6-bbbbbbbbbbbb"
    in_flight.mkdir()
    fd = os.open(in_flight, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert prune_exports(export) == []
    finally:
        os.close(fd)
    assert sorted(os.listdir(root)) == [
        ".tmp-global_step_6-bbbbbbbbbbbb",
        "global_step_1",
        "global_step_5",
    ]
    assert os.listdir(root / "global_step_5" / "policy") == ["notes.txt"]
    # A new export of a step with nothing yet appears whole, in one rename.
    write_safetensors({"w": torch.zeros(2)}, export_dir(export, 7), 100)
    assert check_dir(export_dir(export, 7)) == []
