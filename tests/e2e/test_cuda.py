"""The same guarantees with CUDA tensors: pinned arenas, side-stream copies (skips without CUDA).

Run on a GPU by ``benchmarks/gpu_suite.sh`` (which lists every skip with its reason). What needs
two GPUs says so in its skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncckpt import CheckpointEngine, Distributed, faults
from asyncckpt.testing import parts

HAS_CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAS_CUDA else 0

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device"),
]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same device, dtype, shape and bytes (fp8 has no ``torch.equal`` on every build)."""
    if (got.device, got.dtype, got.shape) != (want.device, want.dtype, want.shape):
        return False
    a = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b = want.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a, b)


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def fp8_dtypes() -> list[torch.dtype]:
    return [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


async def test_cuda_round_trip_and_mutation_after_save(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "w": torch.randn(1024, 1024, device="cuda", generator=g),
        "h": torch.randn(333, device="cuda", generator=g).half(),
        "b": torch.randn(64, device="cuda", generator=g).bfloat16(),
        "mask": torch.randn(77, device="cuda", generator=g) > 0,
        "cpu_opt": torch.randn(1000),
    }
    expected = {k: v.clone() for k, v in state.items()}
    faults.inject("before_shard_write", "delay:0.5")
    async with CheckpointEngine(tmp_path) as engine:
        await engine.prepare(state)
        assert parts(engine).saver.slots[0].pinned
        handle = await engine.save(1, state)
        for t in state.values():
            t.zero_() if t.dtype != torch.bool else t.logical_not_()
        await handle.committed()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    assert await CheckpointEngine(tmp_path).load_latest(target) == 1
    for k in expected:
        assert target[k].device == expected[k].device
        assert torch.equal(target[k], expected[k]), k


def dtype_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every dtype a training state holds, small (< 1 MiB: one foreach copy) and large (the
    per-tensor path), on the GPU, with two CPU tensors beside them."""
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    state = {
        "fp32.large": r(512, 1024),  # 2 MiB
        "fp32.small": r(100),
        "fp16.large": r(1024, 1024).half(),
        "fp16.small": r(7, 3).half(),
        "bf16.large": r(1024, 1024).bfloat16(),
        "bf16.small": r(5).bfloat16(),
        "bool.small": r(1000) > 0,
        "bool.large": r(2 << 20) > 0,
        "int64.small": torch.randint(-(2**40), 2**40, (17,), device="cuda", generator=gen),
        "int64.large": torch.randint(-(2**40), 2**40, (200_000,), device="cuda", generator=gen),
        "int8.small": torch.randint(
            -128, 128, (9,), device="cuda", generator=gen, dtype=torch.int8
        ),
        "scalar": r(()),
        "empty": torch.empty(0, 4, device="cuda"),
        "cpu.fp32": torch.randn(300, 300),
        "cpu.int64": torch.arange(10),
    }
    for dt in fp8_dtypes():
        name = str(dt).removeprefix("torch.")
        state[f"{name}.small"] = r(64).clamp(-8, 8).to(dt)
        state[f"{name}.large"] = r(1024, 1100).clamp(-8, 8).to(dt)
    return state


async def test_cuda_dtypes_and_mixed_devices_load_back_to_cuda(tmp_path):
    state = dtype_state(torch.Generator(device="cuda").manual_seed(1))
    expected = {k: v.clone() for k, v in state.items()}
    async with CheckpointEngine(tmp_path) as engine:
        await (await engine.save(3, state)).committed()
    target = zeros_like_state(expected)
    assert await CheckpointEngine(tmp_path).load_latest(target) == 3
    bad = [k for k in expected if not same_bytes(target[k], expected[k])]
    assert not bad, f"differ after the round trip (device, dtype, shape or bytes): {bad}"
    assert all(target[k].is_cuda for k in expected if not k.startswith("cpu."))


@pytest.mark.skipif(not fp8_dtypes(), reason="this torch has no float8 dtypes")
async def test_cuda_fp8_alone(tmp_path):
    # Separate from the mix above so an fp8-only failure is named as such.
    gen = torch.Generator(device="cuda").manual_seed(2)
    state = {str(dt): torch.randn(4096, device="cuda", generator=gen).to(dt) for dt in fp8_dtypes()}
    expected = {k: v.clone() for k, v in state.items()}
    async with CheckpointEngine(tmp_path) as engine:
        await (await engine.save(1, state)).committed()
    target = zeros_like_state(expected)
    assert await CheckpointEngine(tmp_path).load_latest(target) == 1
    assert all(same_bytes(target[k], expected[k]) for k in expected)


async def test_cuda_queued_writes_before_save_are_in_it_and_after_are_not(tmp_path):
    """Kernels queued on the current stream before ``save`` belong to the checkpoint; the
    in-place update queued right after ``save`` returns (no synchronize) does not."""
    n = 64 << 20  # 256 MiB of fp32: the copies take long enough for a race to show
    w = torch.zeros(n, device="cuda")
    small = torch.zeros(1000, device="cuda")
    faults.inject("before_shard_write", "delay:0.3")
    async with CheckpointEngine(tmp_path) as engine:
        await engine.prepare({"w": w, "small": small})
        for step in (1, 2, 3):
            torch.cuda.synchronize()
            w.fill_(float(step))  # queued, not waited for
            small.fill_(float(step))
            handle = await engine.save(step, {"w": w, "small": small})
            w.add_(1000.0)  # right after save returns, still queued on the stream
            small.add_(1000.0)
            await handle.committed()
            target = {"w": torch.empty_like(w), "small": torch.empty_like(small)}
            assert await engine.load_latest(target) == step
            assert torch.all(target["w"] == float(step)), step
            assert torch.all(target["small"] == float(step)), step


def _arena_snapshot(engine: CheckpointEngine) -> tuple[list[int], list[int]]:
    slots = parts(engine).saver.slots
    return [i for s in slots for i in s.arena_ids], [a.data_ptr() for s in slots for a in s.arenas]


async def test_cuda_pinned_arenas_registered_once_and_reused(tmp_path, monkeypatch):
    from asyncckpt.staging import arenas as staging

    calls: list[tuple[int, bool]] = []
    real = staging.allocate_arena

    def counting(nbytes: int, pin: bool) -> torch.Tensor:
        calls.append((nbytes, pin))
        return real(nbytes, pin)

    monkeypatch.setattr(staging, "allocate_arena", counting)
    gen = torch.Generator(device="cuda").manual_seed(3)
    state = {"w": torch.randn(1 << 20, device="cuda", generator=gen), "cpu": torch.ones(10)}
    async with CheckpointEngine(tmp_path) as engine:
        await engine.prepare(state)
        registered = list(calls)
        assert registered and all(pin for _, pin in registered), registered
        before = _arena_snapshot(engine)
        arenas = [a for s in parts(engine).saver.slots for a in s.arenas]
        assert all(a.is_pinned() for a in arenas), "CUDA does not see the arenas as pinned"
        for step in range(1, 5):
            state["w"].add_(1.0)
            await (await engine.save(step, state)).committed()
            assert _arena_snapshot(engine) == before, f"arenas replaced at save {step}"
        assert calls == registered, f"arenas allocated/registered again: {calls[len(registered) :]}"
    target = {"w": torch.zeros_like(state["w"]), "cpu": torch.zeros(10)}
    assert await CheckpointEngine(tmp_path).load_latest(target) == 4
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["cpu"], state["cpu"])


async def test_cuda_layout_change_dtype_between_saves(tmp_path):
    """Same keys and shapes, dtypes swapped between saves: the second checkpoint holds the new
    dtypes (DCP's .metadata too), new pinned arenas replace the old ones, and each step loads
    back to CUDA with its own dtypes."""
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator(device="cuda").manual_seed(4)
    s1 = {
        "w": torch.randn(512, 1024, device="cuda", generator=gen),
        "b": torch.randn(1000, device="cuda", generator=gen).bfloat16(),
        "cpu": torch.arange(6, dtype=torch.int64),
    }
    s2 = {
        "w": torch.randn(512, 1024, device="cuda", generator=gen).bfloat16(),
        "b": torch.randn(1000, device="cuda", generator=gen),
        "cpu": torch.arange(6, dtype=torch.int32),
    }
    async with CheckpointEngine(tmp_path) as engine:
        await (await engine.save(1, s1)).committed()
        first = _arena_snapshot(engine)
        await (await engine.save(2, s2)).committed()
        second = _arena_snapshot(engine)
        assert set(first[0]).isdisjoint(second[0]), "the old layout's arenas were reused"
        assert all(a.is_pinned() for s in parts(engine).saver.slots for a in s.arenas)
        # And back to the first layout: saved with its own dtypes again.
        await (await engine.save(3, s1)).committed()
        infos = {c.step: c.path for c in engine.list_checkpoints()}
    for step, want in ((1, s1), (2, s2), (3, s1)):
        meta = dcp.FileSystemReader(str(infos[step])).read_metadata().state_dict_metadata
        got = {k: meta[k].properties.dtype for k in want}
        assert got == {k: v.dtype for k, v in want.items()}, (step, got)
        target = zeros_like_state(want)
        assert await CheckpointEngine(tmp_path).load(target, step=step) == step
        bad = [k for k in want if not same_bytes(target[k], want[k])]
        assert not bad, (step, bad)


# ------------------------------------------------------------------------------ two ranks


def save_and_load_on_rank(rank: int, world: int, root: str, device_index: int | None) -> int:
    """One rank of a 2-rank save of CUDA state: rank-owned and replicated tensors, then each
    rank loads it back to its GPU."""
    from asyncckpt import SyncCheckpointEngine

    dev = rank % torch.cuda.device_count() if device_index is None else device_index
    torch.cuda.set_device(dev)

    def state(step: int) -> dict[str, Any]:
        gen = torch.Generator(device="cuda").manual_seed(100 * step + rank)
        return {
            "model": {
                f"own{rank}": torch.randn(3000, device="cuda", generator=gen),
                "shared": torch.full((257,), float(step), device="cuda").bfloat16(),
            },
            "step": step,
        }

    with SyncCheckpointEngine(root, distributed=Distributed(timeout=60)) as engine:
        assert engine.world_size == world and engine.rank == rank
        for step in (1, 2):
            engine.save(step, state(step)).committed_sync(timeout=120)
    want = state(2)
    # Non-tensor leaves come back where the target names them.
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": None}
    got = SyncCheckpointEngine(root).load_latest(target)
    for k, v in want["model"].items():
        assert target["model"][k].device == v.device and torch.equal(target["model"][k], v), k
    assert target["step"] == 2
    return got


def _run_two_ranks(tmp_path: Path, backend: str, device_index: int | None) -> None:
    from test_multirank import run_ranks

    root = tmp_path / "ckpt"
    out = run_ranks(save_and_load_on_rank, 2, tmp_path, str(root), device_index, backend=backend)
    assert out == {0: 2, 1: 2}
    files = set(os.listdir(root / "global_step_2"))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= files, files


def test_cuda_two_ranks_gloo_save_and_load(tmp_path):
    # One GPU is enough: both ranks use device 0 over gloo (NCCL refuses two ranks per GPU).
    _run_two_ranks(tmp_path, "gloo", 0 if GPUS < 2 else None)


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs for an NCCL group (this machine has {GPUS})")
def test_cuda_two_ranks_nccl_save_and_load(tmp_path):
    _run_two_ranks(tmp_path, "nccl", None)


# ------------------------------------------------ the trainer dies: flush-on-death and memory tier
DYING_TRAINER = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[3])
from test_cuda import dying_state
from asyncckpt import SyncCheckpointEngine
root, device = sys.argv[1], sys.argv[2]
engine = SyncCheckpointEngine(root, keep=None)
engine.__enter__()
state = dying_state(1, device)
engine.save(1, state)  # a disk save: returned (staged), not yet committed
print(json.dumps({"worker": engine.worker_pid, "returned": 1}), flush=True)
for step in (2, 3):
    new = dying_state(step, device)
    for k in state:
        state[k].copy_(new[k])
    engine.save(step, state, tier="memory")
    print(json.dumps({"returned": step}), flush=True)
for k in state:
    state[k].zero_()  # the loop goes on mutating its state on the device
os.kill(os.getpid(), signal.SIGKILL)
"""


def dying_state(step: int, device: str) -> dict[str, torch.Tensor]:
    """Several dtypes on ``device`` and one CPU tensor beside them, a function of ``step``."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(1 << 20, generator=g).to(device),
        "h": torch.randn(4096, generator=g).to(torch.bfloat16).to(device),
        "i": (torch.arange(1000) * step).to(device),
        "cpu": torch.full((100,), float(step)),
    }


def run_dying_trainer(tmp_path: Path, device: str) -> Path:
    """A trainer on ``device`` SIGKILLs itself right after a disk save and two memory saves
    returned; waits for its orphaned worker to finish and exit; returns the root."""
    import json
    import signal
    import subprocess
    import sys

    from test_flush_on_death import wait_gone

    script = tmp_path / "trainer.py"
    script.write_text(DYING_TRAINER)
    root = tmp_path / "r"
    # Files, not pipes: the orphaned worker inherits the trainer's output.
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        args = [sys.executable, str(script), str(root), device, str(Path(__file__).parents[1])]
        proc = subprocess.run(args, stdout=out, stderr=err, timeout=300)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "err").read_text()[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "out").read_text().splitlines() if x.strip()]
    assert [x["returned"] for x in lines] == [1, 2, 3]
    wait_gone(lines[0]["worker"], 120)
    return root


def check_dying_trainer_saves(root: Path, device: str) -> None:
    from asyncckpt import SyncCheckpointEngine

    with SyncCheckpointEngine(root, keep=None) as engine:
        # The disk save that had returned is committed; the newest memory save is written.
        assert [c.step for c in engine.list_checkpoints()] == [1, 3]
        for step in (1, 3):
            target = zeros_like_state(dying_state(step, device))
            engine.load(target, step)
            for k, v in dying_state(step, device).items():
                assert same_bytes(target[k], v), (step, k)
        tiers = {c.step: c.tier for c in engine.list_checkpoints()}
    assert tiers == {1: "disk", 3: "memory"}, tiers


def test_cuda_saves_that_returned_survive_the_trainers_sigkill(tmp_path):
    check_dying_trainer_saves(run_dying_trainer(tmp_path, "cuda"), "cuda")


# ------------------------------------------------------------------ differential copies (issue 37)
# Written on a machine with no GPU: these run in the GPU suite (tests/e2e/test_cuda.py).


def test_cuda_device_fingerprint_is_the_cpu_ones_and_sees_one_bit():
    from asyncckpt.staging.unchanged import device_fingerprint

    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 256, (3 * (1 << 20) + 3,), dtype=torch.uint8, generator=g)
    gpu = t.cuda()
    assert torch.equal(device_fingerprint(gpu).cpu(), device_fingerprint(t))
    gpu[12345] ^= 1
    assert not torch.equal(device_fingerprint(gpu).cpu(), device_fingerprint(t))


def test_cuda_fused_fingerprint_kernel_is_trusted_where_triton_is_and_matches_the_torch_ops():
    """The fused kernel (fingerprint_kernel.py, Triton: in the GPU image) passed its self-check
    on this GPU and gives the torch ops' lanes on a tensor of several programs and a partial
    one, odd byte count included; a flipped bit changes them. Where it is turned off, the
    reason says why (the test fails with it: a kernel written without a GPU must be seen
    working on one)."""
    pytest.importorskip("triton", reason="no Triton: the torch ops fingerprint (no kernel)")
    from asyncckpt.staging.unchanged import device_fingerprint, kernel_state, reference_fingerprint

    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, 256, (40 * (1 << 20) + 7,), dtype=torch.uint8, generator=g).cuda()
    got = device_fingerprint(t)
    assert kernel_state()["used"], kernel_state()
    assert torch.equal(got, reference_fingerprint(t))
    t[33 << 20] ^= 1 << 3
    assert not torch.equal(device_fingerprint(t), got)
    assert kernel_state()["used"], kernel_state()


def test_cuda_prepare_runs_the_fused_kernels_self_check_before_the_first_save(tmp_path):
    """Its compile and self-check take seconds on a fresh machine: ``prepare`` pays them, not
    the first save's stall. (Run in a new process: this one's kernel may be trusted already.)"""
    pytest.importorskip("triton", reason="no Triton: no kernel to prepare")
    code = (
        "import sys, torch\n"
        "from asyncckpt import SyncCheckpointEngine\n"
        "from asyncckpt.staging.unchanged import kernel_state\n"
        "state = {'w': torch.ones(1 << 22, device='cuda')}\n"
        "with SyncCheckpointEngine(sys.argv[1]) as engine:\n"
        "    assert kernel_state()['reason'] == 'not tried yet', kernel_state()\n"
        "    engine.prepare(state)\n"
        "    assert kernel_state()['used'], kernel_state()\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


#: The ways to change a CUDA tensor's bytes, with those no version counter sees.
CUDA_MUTATIONS = {
    "in_place_op": lambda t: t.mul_(2),
    "data_write": lambda t: t.data.__setitem__((0, 0), 42.0),
    "data_copy_": lambda t: t.data.copy_(torch.full_like(t, 3.0)),
    "set_same_size": lambda t: t.set_(torch.full_like(t, 5.0)),
}


@pytest.mark.parametrize("mutation", list(CUDA_MUTATIONS))
def test_cuda_differential_copies_skip_and_load_bit_for_bit(tmp_path, mutation):
    import torch.distributed.checkpoint as dcp

    from asyncckpt import SyncCheckpointEngine
    from asyncckpt.core import layout

    g = torch.Generator(device="cuda").manual_seed(0)
    model = {k: torch.randn(256, 1024, device="cuda", generator=g) for k in "abcd"}  # 1 MiB
    state = {"model": model}
    want, stats = {}, {}
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        for step in range(1, 6):
            if step == 4:
                CUDA_MUTATIONS[mutation](model["a"])
            want[step] = {k: v.detach().cpu().clone() for k, v in model.items()}
            stats[step] = engine.save(step, state).committed_sync()
    for step, w in want.items():
        target = {"model": {k: torch.empty_like(v) for k, v in w.items()}}
        path = tmp_path / layout.dir_name("global_step", step)
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
        for k in w:
            assert same_bytes(target["model"][k], w[k]), (step, k)
    assert stats[3].copy_skipped_bytes == 4 << 20  # fingerprinted on the GPU, not copied
    assert stats[4].copy_skipped_bytes == 3 << 20  # the changed one copied


def test_cuda_a_view_off_a_4_byte_boundary_is_copied_not_fingerprinted(tmp_path):
    """A bf16 slice of a flat buffer at an odd element (as flat-parameter views are) cannot be
    read as int32 words in place: it is copied every save, counted as a fallback, never fails
    the save or turns the fused kernel off; the aligned tensor beside it is still skipped."""
    import torch.distributed.checkpoint as dcp

    from asyncckpt import SyncCheckpointEngine
    from asyncckpt.core import layout
    from asyncckpt.staging.unchanged import kernel_state

    g = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.randn(1 << 20, device="cuda", generator=g).to(torch.bfloat16)  # 2 MiB
    odd = flat[1 : (1 << 20) - 1]
    assert odd.data_ptr() % 4 == 2
    aligned = torch.randn(1 << 20, device="cuda", generator=g)  # 4 MiB
    state = {"model": {"odd": odd, "aligned": aligned}}
    want, stats = {}, {}
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        for step in (1, 2, 3):
            if step == 3:
                odd.mul_(2)
            want[step] = {k: v.detach().cpu().clone() for k, v in state["model"].items()}
            stats[step] = engine.save(step, state).committed_sync()
    for step, w in want.items():
        target = {"model": {k: torch.empty_like(v) for k, v in w.items()}}
        dcp.load(target, checkpoint_id=str(tmp_path / layout.dir_name("global_step", step)),
                 no_dist=True)  # fmt: skip
        for k in w:
            assert same_bytes(target["model"][k], w[k]), (step, k)
    for step in (2, 3):
        assert stats[step].copy_skip_fallbacks >= 1, step
        assert stats[step].copy_skipped_bytes in (0, 4 << 20), step  # never the odd one's
    assert "raised" not in kernel_state()["reason"]


@pytest.mark.serial  # compares rates: the GPU suite runs it after the others, alone
def test_cuda_device_fingerprints_stay_on_only_where_they_cost_less_than_the_copy(tmp_path, caplog):
    """An unchanged 256 MiB state saved 3 times: either the device fingerprint read faster than
    the copy (the later saves skip every large tensor) or it was turned off after the first
    save, said in a warning, and the later saves copy all 4 tensors (counted as fallbacks);
    every step loads bit for bit either way. (The GPU suite's H200: 0.21 s to fingerprint 8 GiB,
    0.16 s to copy it.)"""
    import torch.distributed.checkpoint as dcp

    from asyncckpt import SyncCheckpointEngine
    from asyncckpt.core import layout

    g = torch.Generator(device="cuda").manual_seed(0)
    model = {k: torch.randn(16 << 20, device="cuda", generator=g) for k in "abcd"}  # 64 MiB
    with caplog.at_level("WARNING", logger="asyncckpt.staging.unchanged"):
        with SyncCheckpointEngine(tmp_path, keep=None) as engine:
            stats = [engine.save(step, {"model": model}).committed_sync() for step in (1, 2, 3)]
    said = [r for r in caplog.records if "fingerprinting on the GPU" in r.getMessage()]
    # The rule's decision, checked against rates measured here: a fingerprint clearly slower
    # than the copy must have been turned off, one clearly faster kept (between, either).
    fp_rate, copy_rate = _fingerprint_and_copy_rates(list(model.values()))
    if fp_rate * 1.25 < copy_rate:
        assert said, (fp_rate, copy_rate)
    elif fp_rate > copy_rate * 1.25:
        assert not said, (fp_rate, copy_rate, [r.getMessage() for r in said])
    if said:
        assert len(said) == 1
        assert [(s.copy_skipped_bytes, s.copy_skip_fallbacks) for s in stats[1:]] == [(0, 4)] * 2
    else:
        assert [s.copy_skipped_bytes for s in stats[1:]] == [256 << 20] * 2
    want = {k: v.cpu() for k, v in model.items()}
    for step in (1, 2, 3):
        target = {"model": {k: torch.empty_like(v) for k, v in want.items()}}
        path = tmp_path / layout.dir_name("global_step", step)
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
        for k in want:
            assert same_bytes(target["model"][k], want[k]), (step, k)


def _fingerprint_and_copy_rates(tensors: list[torch.Tensor]) -> tuple[float, float]:
    """Bytes per second of ``device_fingerprint`` over ``tensors`` and of their copy into
    pinned host memory, each the best of 3 (after a warm-up)."""
    from asyncckpt.staging.unchanged import device_fingerprint

    nbytes = sum(t.nbytes for t in tensors)
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times)

    def copy() -> None:
        for h, t in zip(hosts, tensors, strict=True):
            h.copy_(t, non_blocking=True)

    return best(lambda: [device_fingerprint(t) for t in tensors]), best(copy)


# ------------------------------------------- loads into CUDA targets (issue 34): hot and cold
# Written on a machine with no GPU: these run in the GPU suite. Each path copies host bytes into
# the device through reused pinned buffers, which no CPU test reaches.


def test_cuda_hot_load_through_the_pinned_bounce_is_bit_for_bit():
    """An offer's memory into CUDA targets (hot_load._copy_all -> hotread._to_device): a tensor
    of 2.5 bounce buffers (both buffers reused, a partial last piece), small ones and a CPU
    tensor beside them; then a flipped bit in a device tensor's memory declines before any
    byte went into the device (its target untouched)."""
    from test_hot_resume import offered

    from asyncckpt.formats.hotread import BOUNCE_BYTES, HotDeclined
    from asyncckpt.memory.hot_load import HotSpoiled, load_offered

    g = torch.Generator().manual_seed(5)
    state = {
        "big": torch.randn(BOUNCE_BYTES * 5 // 2 // 4 + 3, generator=g),
        "fp16": torch.randn(1000, generator=g).half(),  # (the helper's .numpy(): no bf16)
        "ids": torch.arange(77) * 3,
        "cpu": torch.randn(100, generator=g),
        "meta": {"lr": 0.5},
    }
    offer, memory = offered(state)
    target: dict[str, Any] = {
        k: torch.zeros_like(v, device="cpu" if k == "cpu" else "cuda")
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }
    target["meta"] = {}
    load_offered(target, offer, memory, strict=True)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert target[k].device.type == ("cpu" if k == "cpu" else "cuda"), k
            assert same_bytes(target[k].cpu(), v), k
    assert target["meta"] == {"lr": 0.5}

    memory["big"][BOUNCE_BYTES + 12345] ^= 0x10  # in the second bounce buffer's piece
    fresh = {k: torch.zeros_like(v) for k, v in target.items() if isinstance(v, torch.Tensor)}
    fresh["meta"] = {}
    with pytest.raises(HotDeclined, match=r"did not match the checksums offered: \['big'\]") as e:
        load_offered(fresh, offer, memory, strict=True)
    assert not isinstance(e.value, HotSpoiled)  # a device target is checked before any copy
    assert not fresh["big"].any() and fresh["meta"] == {}


HOT_TRAINER = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[2])
from test_cuda import dying_state
from asyncckpt import MemoryTier, SyncCheckpointEngine
engine = SyncCheckpointEngine(sys.argv[1], keep=None, memory=MemoryTier(hold_seconds=60))
engine.__enter__()  # never left: the trainer dies inside
state = dying_state(2, "cuda")
engine.save(2, state, tier="memory")
print(json.dumps({"worker": engine.worker_pid}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_cuda_hot_resume_into_cuda_targets_after_the_trainers_sigkill(tmp_path):
    """A CUDA trainer's memory save, the trainer SIGKILLed: a new engine takes the step from
    the surviving worker's memory (no file read) into CUDA targets, bit for bit."""
    import json
    import signal
    import subprocess
    import sys

    from test_flush_on_death import wait_gone

    from asyncckpt import SyncCheckpointEngine

    script = tmp_path / "trainer.py"
    script.write_text(HOT_TRAINER)
    root = tmp_path / "r"
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        args = [sys.executable, str(script), str(root), str(Path(__file__).parents[1])]
        proc = subprocess.run(args, stdout=out, stderr=err, timeout=300)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "err").read_text()[-3000:]
    worker = json.loads((tmp_path / "out").read_text().splitlines()[0])["worker"]
    want = dying_state(2, "cuda")
    target = zeros_like_state(want)
    engine = SyncCheckpointEngine(root, keep=None)
    # Before start(), as a resume makes it (restore.py's LOADER): taken while the worker
    # commits it; start() then waits for that commit.
    assert engine.load_latest(target) == 2
    report = engine.last_load_report
    with engine:
        assert [c.step for c in engine.list_checkpoints()] == [2]
    assert report.source == "memory", report.source_reason
    bad = [k for k in want if not same_bytes(target[k], want[k])]
    assert not bad, bad
    wait_gone(worker, 60)  # taken: the worker that held it is gone


def cold_state(step: int) -> dict[str, Any]:
    """Tensors read in place (16 MiB each: several pinned-buffer batches), an odd-sized one,
    a small one and an object, on the CPU (saved) or as CUDA targets."""
    g = torch.Generator().manual_seed(step)
    model = {f"w{i}": torch.randn(4096, 1024, generator=g) for i in range(3)}
    model["odd"] = torch.randn(1_000_003, generator=g).bfloat16()
    model["small"] = torch.randn(5, generator=g)
    return {"model": model, "step": step}


def cuda_target(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v, device="cuda") for k, v in state["model"].items()}}


def test_cuda_cold_load_into_cuda_targets_through_pinned_buffers(tmp_path):
    """A verified load from disk into CUDA targets (wholefiles: each thread's pinned buffer,
    then a copy across), bit for bit; with a fresh engine, as a resume makes it."""
    from asyncckpt import SyncCheckpointEngine

    with SyncCheckpointEngine(tmp_path) as engine:
        for step in (1, 2):
            engine.save(step, cold_state(step)).committed_sync()
    for step in (2, 1):
        target = cuda_target(cold_state(step))
        target["step"] = -1
        assert SyncCheckpointEngine(tmp_path).load(target, step=step) == step
        want = cold_state(step)
        bad = [k for k, v in want["model"].items() if not same_bytes(target["model"][k].cpu(), v)]
        assert not bad and all(t.is_cuda for t in target["model"].values()), bad
        assert target["step"] == step


def test_cuda_cold_load_damage_changes_nothing_of_a_cuda_target(tmp_path):
    """Invariant 11 with CUDA targets: damage in a large tensor's bytes, nothing older to fall
    back to: the load raises and no byte went into the device."""
    import torch.distributed.checkpoint as dcp

    from asyncckpt import CorruptCheckpoint, SyncCheckpointEngine

    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, cold_state(1)).committed_sync()
    directory = next(tmp_path.glob("global_step_*"))
    where = dcp.FileSystemReader(str(directory)).read_metadata().storage_data
    info = next(i for index, i in where.items() if index.fqn == "model.w2")
    path = directory / info.relative_path
    with open(path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([b[0] ^ 1]))
    target = cuda_target(cold_state(1))
    target["step"] = -1
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        SyncCheckpointEngine(tmp_path).load(target, step=1)
    assert target["step"] == -1
    assert [k for k, t in target["model"].items() if t.any()] == []


def test_cuda_chunked_staging_from_cuda_loads_bit_for_bit(tmp_path):
    """A CUDA state over ``Staging(max_host_bytes=)``: staged in chunks from the device (one
    tensor larger than a chunk: copied in slices), the pinned chunk buffers reused by the next
    save; each step loads back to CUDA bit for bit, also with plain ``dcp.load``; an update
    queued right after ``save`` returns is not in it."""
    import torch.distributed.checkpoint as dcp

    from asyncckpt import Staging, SyncCheckpointEngine

    def state_at(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(step)
        return {
            "emb": torch.randn(2048, 1024, device="cuda", generator=g),  # 8 MiB > a chunk
            "w": torch.randn(512, 512, device="cuda", generator=g).bfloat16(),
            "b": torch.randn(7, device="cuda", generator=g),
            "cpu": torch.randn(1000, generator=torch.Generator().manual_seed(step)),
        }

    root = tmp_path / "r"
    with SyncCheckpointEngine(root, staging=Staging(max_host_bytes=4 << 20)) as engine:
        state = state_at(1)
        stats = {}
        for step in (1, 2):
            state = {k: v.copy_(state_at(step)[k]) for k, v in state.items()}
            stats[step] = engine.save(step, state).committed_sync(120)
            state["emb"].add_(1.0)  # after save returned: not in it
        assert stats[1].chunks >= 3 and stats[2].chunks == stats[1].chunks
    for step in (1, 2):
        want = state_at(step)
        target = zeros_like_state(want)
        assert SyncCheckpointEngine(root).load(target, step=step) == step
        assert all(same_bytes(target[k], v) for k, v in want.items()), step
        plain = zeros_like_state(want)
        dcp.load(plain, checkpoint_id=str(root / f"global_step_{step}"), no_dist=True)
        assert all(same_bytes(plain[k], v) for k, v in want.items()), step
