"""The device fingerprint's fused kernel (fingerprint_kernel.py) and its guard in unchanged.py.

The kernel itself runs here on CPU tensors under Triton's interpreter, in a subprocess (the
interpreter is chosen when Triton is imported: ``TRITON_INTERPRET=1`` must be set before, and
never in this process). Its compiled CUDA run needs a GPU (tests/e2e/test_cuda.py's fingerprint
test goes through it there). The guard (self-check, fallback, warning) is tested with stand-in
kernels and needs no Triton.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import asyncckpt.staging.fingerprint_kernel as fk
import asyncckpt.staging.unchanged as unchanged
from asyncckpt.staging.unchanged import device_fingerprint, kernel_state, reference_fingerprint

ROOT = Path(__file__).resolve().parents[2]
W = fk.WORDS_PER_PROGRAM


def original_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``device_fingerprint`` as first written (out-of-place torch ops): the format, frozen."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    n = raw.numel()
    body = n - n % 4
    words = raw[:body].view(torch.int32)
    lanes = torch.zeros(len(unchanged._LANES), dtype=torch.int64, device=raw.device)
    chunk = unchanged._CHUNK_WORDS
    pieces = [(words[s : s + chunk], s) for s in range(0, words.numel(), chunk)]
    if body < n:
        shifts = torch.arange(n - body, dtype=torch.int32, device=raw.device) * 8
        tail = (raw[body:].to(torch.int32) << shifts).sum(dtype=torch.int32).reshape(1)
        pieces.append((tail, body // 4))
    for w, start in pieces:
        pos = torch.arange(start, start + w.numel(), dtype=torch.int32, device=raw.device)
        for k, (key, m1, m2) in enumerate(unchanged._LANES):
            x = w ^ (pos * key)
            x = x * m1
            x = x ^ ((x >> 16) & 0xFFFF)
            x = x * m2
            x = x ^ ((x >> 13) & 0x7FFFF)
            lanes[k] += x.sum(dtype=torch.int64)
    return lanes


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """This test's own kernel standing (the module's is per process)."""
    monkeypatch.setattr(
        unchanged, "_kernel", {"used": False, "reason": "not tried yet", "fallbacks": 0}
    )
    monkeypatch.setattr(unchanged, "_kernel_devices", set())


# ------------------------------------------------------------------ the torch ops (reference)


@pytest.mark.parametrize("nbytes", [0, 1, 3, 4, 7, 64, 1001, 4 * W + 5])
def test_the_in_place_torch_ops_give_the_original_lanes(nbytes, monkeypatch):
    t = random_bytes(nbytes, nbytes)
    assert torch.equal(reference_fingerprint(t), original_fingerprint(t))
    monkeypatch.setattr(unchanged, "_CHUNK_WORDS", 100)  # in pieces, too
    assert torch.equal(reference_fingerprint(t), original_fingerprint(t))
    assert torch.equal(t, random_bytes(nbytes, nbytes))  # and the source is left as it was


def test_the_torch_ops_wrap_word_positions_past_2_31_as_the_original():
    words = random_bytes(4 * 1000, 1).view(torch.int32)
    start = (1 << 31) - 300
    got = torch.zeros(2, dtype=torch.int64)
    unchanged._mix_into(got, words, start)
    pos = torch.arange(start, start + 1000, dtype=torch.int32)
    want = torch.zeros(2, dtype=torch.int64)
    for k, (key, m1, m2) in enumerate(unchanged._LANES):
        x = (words ^ (pos * key)) * m1
        x = x ^ ((x >> 16) & 0xFFFF)
        x = x * m2
        x = x ^ ((x >> 13) & 0x7FFFF)
        want[k] = x.sum(dtype=torch.int64)
    assert torch.equal(got, want)


def test_cpu_tensors_never_take_the_kernel_outside_the_interpreter(fresh_kernel_state):
    if fk.interpreting():
        pytest.skip("TRITON_INTERPRET=1 in this process")
    assert not fk.usable_on(torch.device("cpu"))
    assert fk.fused_lanes(torch.zeros(4, dtype=torch.int32), 0, unchanged._LANES) is None
    t = random_bytes(1001, 0)
    assert torch.equal(device_fingerprint(t), original_fingerprint(t))
    assert unchanged._kernel["reason"] == "not tried yet"  # no self-check ran


# ------------------------------------------------------------------ the guard (no Triton needed)


def stand_in(monkeypatch, fused):
    """Make the kernel "run" on CPU tensors as ``fused`` (words, start, lanes) -> lanes."""
    calls = []

    def fake(words, start, lanes):
        calls.append(words.numel())
        return fused(words, start, lanes)

    monkeypatch.setattr(fk, "usable_on", lambda device: True)
    monkeypatch.setattr(fk, "fused_lanes", fake)
    return calls


def torch_lanes(words, start, lanes):
    return unchanged._torch_lanes(words, start)


def test_a_kernel_that_passes_its_self_check_is_used_checked_once(
    monkeypatch, fresh_kernel_state, caplog
):
    calls = stand_in(monkeypatch, torch_lanes)
    t = random_bytes(4 * W + 7, 3)
    with caplog.at_level("WARNING", logger="asyncckpt.staging.unchanged"):
        assert torch.equal(device_fingerprint(t), original_fingerprint(t))
        checked = len(calls)
        assert checked > 1  # the self-check's runs, then this tensor's
        assert torch.equal(device_fingerprint(t), original_fingerprint(t))
    assert len(calls) == checked + 1  # no second self-check on this device
    assert caplog.records == []
    assert kernel_state() == {"used": True, "reason": "", "fallbacks": 0}


def test_a_kernel_turned_off_during_another_devices_self_check_stays_off(
    monkeypatch, fresh_kernel_state, caplog
):
    """One device's self-check passing must not re-enable a kernel that a failure elsewhere
    turned off while it ran (it set used=True, reason="" over the "off")."""
    stand_in(monkeypatch, torch_lanes)
    real = unchanged._self_check

    def meanwhile_off(device):
        unchanged._kernel_failed("raised on another device meanwhile")
        return real(device)

    monkeypatch.setattr(unchanged, "_self_check", meanwhile_off)
    t = random_bytes(4 * W + 7, 5)
    with caplog.at_level("WARNING", logger="asyncckpt.staging.unchanged"):
        assert torch.equal(device_fingerprint(t), original_fingerprint(t))
    state = kernel_state()
    assert not state["used"] and state["reason"].startswith("off:"), state
    assert len([r for r in caplog.records if "fell back" in r.getMessage()]) == 1


def wrong_by_one(words, start, lanes):
    return torch_lanes(words, start, lanes) + 1


def blind_to_bytes(words, start, lanes):
    """Right for the first words it sees, then the same answer for any words of that size."""
    seen = blind_to_bytes.__dict__.setdefault("seen", {})
    if words.numel() not in seen:
        seen[words.numel()] = torch_lanes(words, start, lanes)
    return seen[words.numel()].clone()


def raises(words, start, lanes):
    raise RuntimeError("no kernel image is available for execution on the device")


def wrong_past_2_31(words, start, lanes):
    return torch_lanes(words, start, lanes) + (start > 0)


@pytest.mark.parametrize(
    "fused, why",
    [
        (wrong_by_one, "torch ops"),
        (blind_to_bytes, "flipped bit"),
        (raises, "no kernel image"),
        (wrong_past_2_31, "wrapping positions"),
    ],
)
def test_a_kernel_failing_its_self_check_falls_back_for_good_said_once_and_counted(
    monkeypatch, fresh_kernel_state, caplog, fused, why
):
    blind_to_bytes.__dict__.pop("seen", None)
    calls = stand_in(monkeypatch, fused)
    t = random_bytes(1001, 4)
    with caplog.at_level("WARNING", logger="asyncckpt.staging.unchanged"):
        assert torch.equal(device_fingerprint(t), original_fingerprint(t))
        checked = len(calls)
        assert torch.equal(device_fingerprint(t), original_fingerprint(t))
        assert len(calls) == checked  # never run again
    state = kernel_state()
    assert not state["used"] and "self-check on cpu" in state["reason"] and why in state["reason"]
    assert state["fallbacks"] == 2  # both fingerprints, by the torch ops
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "fast path fell back" in record.getMessage() and why in record.getMessage()


def test_a_trusted_kernel_that_raises_later_falls_back_with_the_right_lanes(
    monkeypatch, fresh_kernel_state, caplog
):
    def ok_for_the_probe(words, start, lanes):
        if words.numel() == 12345:
            raise RuntimeError("out of memory")
        return torch_lanes(words, start, lanes)

    stand_in(monkeypatch, ok_for_the_probe)
    t = random_bytes(4 * 12345, 5)
    with caplog.at_level("WARNING", logger="asyncckpt.staging.unchanged"):
        assert torch.equal(device_fingerprint(t), original_fingerprint(t))
    assert not kernel_state()["used"] and "out of memory" in kernel_state()["reason"]
    assert "fast path fell back" in caplog.records[0].getMessage()


def test_kernel_state_says_why_not_without_triton(monkeypatch, fresh_kernel_state):
    monkeypatch.setattr(fk, "available", lambda: False)
    assert kernel_state() == {"used": False, "reason": "triton is not importable", "fallbacks": 0}


# ------------------------------------------------------------------ the kernel (interpreter)

INTERPRETED = textwrap.dedent(
    """
    import json, torch
    import asyncckpt.staging.fingerprint_kernel as fk
    import asyncckpt.staging.unchanged as u
    from asyncckpt.staging.unchanged import device_fingerprint, reference_fingerprint

    W = fk.WORDS_PER_PROGRAM
    out = {}

    def rand(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    def fused(words, start=0):
        return fk.fused_lanes(words, start, u._LANES).tolist()

    def ref(words, start=0):
        return u._torch_lanes(words, start).tolist()

    for n in [0, 1, 2, W - 1, W, W + 1, 3 * W + 17]:
        words = rand(4 * n, n).view(torch.int32)
        out[f"words {n}"] = [fused(words), ref(words)]
    words = rand(4 * (W + 9), 7).view(torch.int32)
    out["extreme words"] = [
        fused(torch.full((W + 9,), v, dtype=torch.int32)) + [v] for v in (-(1 << 31), -1, 0)
    ]
    out["extreme words ref"] = [
        ref(torch.full((W + 9,), v, dtype=torch.int32)) + [v] for v in (-(1 << 31), -1, 0)
    ]
    out["wrapping positions"] = [fused(words, (1 << 31) - 40), ref(words, (1 << 31) - 40)]
    out["start"] = [fused(words, 12345), ref(words, 12345)]

    for nbytes in [0, 1, 3, 5, 4 * W - 1, 4 * W + 2, 4 * (2 * W + 3) + 3]:
        t = rand(nbytes, nbytes)
        out[f"bytes {nbytes}"] = [device_fingerprint(t).tolist(), reference_fingerprint(t).tolist()]
    out["state"] = u.kernel_state()

    t = rand(4 * (2 * W + 100) + 3, 11)
    base = device_fingerprint(t)
    flips = []
    for i in [0, 1, 4 * W - 1, 4 * W, 4 * (2 * W + 50), t.numel() - 1]:
        for bit in (0, 7):
            u_ = t.clone()
            u_[i] ^= 1 << bit
            got = device_fingerprint(u_)
            flips.append([i, bit, torch.equal(got, base), torch.equal(got, reference_fingerprint(u_))])
    out["flips"] = flips

    words = t[: 4 * (2 * W + 100)].view(torch.int32)
    swapped = words.clone()
    swapped[[3, W + 5]] = swapped[[W + 5, 3]]
    out["swap"] = torch.equal(device_fingerprint(swapped), device_fingerprint(words))
    out["flip order"] = torch.equal(device_fingerprint(words.flip(0)), device_fingerprint(words))
    out["bytes not values"] = torch.equal(
        device_fingerprint(words.view(torch.float32)), device_fingerprint(words)
    )
    # A bf16 view at an odd element starts off a 4-byte boundary: the same lanes as its bytes
    # copied, and the kernel stays on (it raised and was turned off for good before).
    buf = rand(2 * (2 * W + 9), 5).view(torch.bfloat16)
    odd = buf[1:]
    out["misaligned"] = [
        device_fingerprint(odd).tolist(),
        device_fingerprint(odd.clone()).tolist(),
        reference_fingerprint(odd.clone()).tolist(),
    ]
    out["final state"] = u.kernel_state()
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton", reason="triton is not installed: the kernel cannot run")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("n", [0, 1, 2, W - 1, W, W + 1, 3 * W + 17])
def test_the_kernel_gives_the_torch_ops_lanes(interpreted, n):
    got, want = interpreted[f"words {n}"]
    assert got == want
    if n == 0:
        assert got == [0, 0]


def test_the_kernel_gives_them_for_extreme_words_and_any_start(interpreted):
    assert interpreted["extreme words"] == interpreted["extreme words ref"]
    for key in ("wrapping positions", "start"):
        got, want = interpreted[key]
        assert got == want, key


@pytest.mark.parametrize("nbytes", [0, 1, 3, 5, 4 * W - 1, 4 * W + 2, 4 * (2 * W + 3) + 3])
def test_device_fingerprint_through_the_kernel_is_the_torch_ops_one(interpreted, nbytes):
    got, want = interpreted[f"bytes {nbytes}"]
    assert got == want
    assert interpreted["state"] == {"used": True, "reason": "", "fallbacks": 0}


def test_the_kernel_sees_every_flipped_bit(interpreted):
    for i, bit, same_as_base, same_as_reference in interpreted["flips"]:
        assert not same_as_base, (i, bit)
        assert same_as_reference, (i, bit)


def test_the_kernel_sees_words_moved_not_their_dtype(interpreted):
    assert not interpreted["swap"]
    assert not interpreted["flip order"]
    assert interpreted["bytes not values"]
    assert interpreted["final state"]["used"]


def test_the_kernel_takes_a_view_off_a_4_byte_boundary_and_stays_on(interpreted):
    got, copied, reference = interpreted["misaligned"]
    assert got == copied == reference
    assert interpreted["final state"] == {"used": True, "reason": "", "fallbacks": 0}


def test_a_view_off_a_4_byte_boundary_is_fingerprinted_as_its_bytes(fresh_kernel_state):
    """A bf16 slice at an odd element cannot be read as int32 words in place (it raised, and
    on a GPU failed the save): its lanes are those of its bytes, copied."""
    buf = random_bytes(2 * 4099, 8).view(torch.bfloat16)
    odd = buf[1:4000]
    assert odd.data_ptr() % 4 == 2
    want = original_fingerprint(odd.clone())
    assert torch.equal(device_fingerprint(odd), want)
    assert torch.equal(reference_fingerprint(odd), want)
    assert not torch.equal(device_fingerprint(buf[2:4001]), want)  # other bytes, other lanes


def test_a_storage_imported_off_a_boundary_and_sliced_back_onto_one_is_fingerprinted():
    """torch's int32 view checks the byte offset in the storage, not the address: a storage
    imported misaligned (NumPy, DLPack) and sliced back onto a 4-byte address still raised."""
    np = pytest.importorskip("numpy")
    base = np.frombuffer(random_bytes(2 * 4101, 9).numpy().tobytes(), dtype=np.float16)
    t = torch.from_numpy(base[1:])[1:]  # the storage starts 2 bytes off; the slice, on 4
    if t.data_ptr() % 4 or (t.storage_offset() * 2) % 4 == 0:
        pytest.skip("this allocation did not give the misaligned storage the case needs")
    assert not unchanged.word_aligned(t)
    assert torch.equal(device_fingerprint(t), original_fingerprint(t.clone()))


def test_the_kernel_compiles_no_overflow_assert_even_in_tritons_debug_mode():
    """Its int32 products and sums wrap on purpose. In debug mode (``TRITON_DEBUG=1``) Triton
    compiles an overflow assert into every int32 ``*`` and ``+`` unless told not to, and on a
    GPU such an assert breaks the process's CUDA context at the first self-check. Compiled
    here for an H100/H200 (sm_90) with debug on; the interpreter never checks overflow."""
    triton = pytest.importorskip("triton", reason="triton is not installed: nothing to compile")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = fk._kernel()
    assert kernel is not None
    consts = dict(zip(("K0", "A0", "B0"), unchanged._LANES[0], strict=True))
    consts.update(zip(("K1", "A1", "B1"), unchanged._LANES[1], strict=True))
    consts.update(BLOCK=fk.BLOCK, ITERS=fk.ITERS)
    for masked in (False, True):
        src = ASTSource(
            kernel,
            signature={
                "words_ptr": "*i32",
                "out_ptr": "*i64",
                "first": "i32",
                "rem": "i32",
                "start": "i32",
                **{k: "constexpr" for k in [*consts, "MASKED"]},
            },
            constexprs={**consts, "MASKED": masked},
        )
        try:
            ttir = triton.compile(
                src, target=GPUTarget("cuda", 90, 32), options={"debug": True}
            ).asm["ttir"]
        except Exception as e:  # no compiler backend for this wheel on this machine
            pytest.skip(f"cannot compile for sm_90 here: {e!r}")
        assert "tt.assert" not in ttir, (masked, [ln for ln in ttir.splitlines() if "assert" in ln])


def test_prepare_warms_the_kernel_once_per_gpu_the_state_is_on_and_only_when_it_will_run(
    monkeypatch,
):
    """``CopySkipper.warm`` (called by ``prepare``): the self-check and compile per GPU, not in
    the first save; nothing for CPU tensors, with differential copies off, or once the device
    fingerprint was turned off."""
    from types import SimpleNamespace

    warmed = []
    monkeypatch.setattr(unchanged, "prepare_fingerprint", warmed.append)

    def on(index):
        return SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))

    state = {"a": on(0), "b": on(0), "c": on(1), "d": torch.zeros(4)}
    unchanged.CopySkipper(True).warm(state)
    assert sorted(d.index for d in warmed) == [0, 1]
    warmed.clear()
    unchanged.CopySkipper(False).warm(state)
    off = unchanged.CopySkipper(True)
    off.on_device = False
    off.warm(state)
    unchanged.CopySkipper(True).warm({"d": torch.zeros(4)})
    assert warmed == []
