"""Differential saves, the trainer's half: a tensor whose bytes the staging slot already holds
is not copied into it again (the worker's half, differential.py, then links its file).

Which buffer holds a skipped tensor's bytes: the slot being staged, itself. Every slot keeps,
per large tensor, the fingerprint of the bytes its view holds now (``StagingSlot.held``); a
save skips the copy of a tensor only where the fingerprint of the tensor's bytes, computed now
where it lives, equals what *this* slot holds. Slots that alternate (``max_in_flight`` > 1, the
memory tier's two) each answer for their own bytes, so a tensor changed and changed back between
two saves is never taken from the other slot's copy.

Soundness (invariant 15) rests on the bytes alone:

- the version counter and data pointer are a pre-filter only: a tensor written in place since
  the last save (its counter moved) is copied without a fingerprint (no cost for the trained
  parameters); everything else (frozen, or written where no counter moves: ``.data``, NumPy
  views, ``.data.copy_()`` weight syncs) is fingerprinted and compared;
- on the CPU what a slot holds is fingerprinted from the slot's own bytes after the copy (and
  the save found untorn), so the record is exact even if the source raced the copy; on a GPU
  the source is fingerprinted on the copy stream right before its copy (``device_fingerprint``:
  exact integer arithmetic, a single changed 32-bit word always changes it; written, tested on
  CPU tensors, its CUDA run needs a GPU);
- an entry is dropped before its view is overwritten, and a torn or failed copy records
  nothing new: a slot never claims bytes it may not hold.

Tensors under ``SMALL_TENSOR_BYTES`` are always copied (one foreach call for all of them costs
less than fingerprinting them one by one); so are strided CPU tensors, and GPU tensors that
are strided or start off a 4-byte boundary (counted: ``fallbacks``).

On a GPU the fingerprint must pay for itself: it reads every byte it may spare the copy of. As
torch ops (a dozen passes per lane over temporaries) it cost more than the copy where the D2H
link is fast (an H200: 8 GiB fingerprinted in 0.21 s, copied in 0.16 s); where Triton is
installed a fused kernel (fingerprint_kernel.py: one read of the bytes) computes the same lanes,
trusted on a device only once a self-check there matched the torch ops (else the torch ops are
used: logged once, ``kernel_state``). Whether the fingerprint pays is still measured per save,
either way (``fingerprint_pays``); once it reads a byte slower than the copy moves one, GPU
tensors are copied without it from then on (logged once, counted in ``fallbacks``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncckpt.core.cachekeys import same_key
from asyncckpt.errors import StateModifiedWhileStaging
from asyncckpt.staging import fingerprint_kernel
from asyncckpt.staging.arenas import (
    Marks,
    StagingSlot,
    _as_bytes,
    _pool,
    copy_checked,
    cpu_copy_threads,
    side_stream,
    torn_since,
)
from asyncckpt.staging.bytecheck import changed_since_copied
from asyncckpt.staging.fingerprints import fingerprint_bytes

#: The torch ops of ``device_fingerprint`` work through a tensor in pieces of this many 32-bit
#: words (bounds their temporaries to three times 64 MiB on the device; the kernel has none).
_CHUNK_WORDS = 1 << 24
#: Per lane: a position key and two odd multipliers (murmur3's finaliser, keyed by position).
_LANES = ((0x2545F491, 0x27D4EB2F, 0x165667B1), (0x3C6EF372, 0x1B873593, 0x2C1B3C6D))
#: Below this many bytes fingerprinted or copied in a save, its timings decide nothing.
MEASURE_MIN_BYTES = 64 << 20

log = logging.getLogger(__name__)


def fingerprint_pays(
    fp_bytes: int, fp_seconds: float, copy_bytes: int, copy_seconds: float
) -> bool | None:
    """Whether fingerprinting on the device reads a byte at least as fast as the copy moves
    one (else skipping a copy never wins back what the fingerprint cost); None where a save
    measured too little of either to tell."""
    if min(fp_bytes, copy_bytes) < MEASURE_MIN_BYTES or fp_seconds <= 0 or copy_seconds <= 0:
        return None
    return fp_bytes / fp_seconds >= copy_bytes / copy_seconds


def device_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 lanes over a contiguous tensor's bytes, computed on its own device (a read at
    device bandwidth; the D2H copy it can spare crosses PCIe).

    Each 32-bit word, keyed by its position, goes through a bijective mix (odd multiplies,
    xor-shifts: int32 arithmetic wraps) and the lanes are exact int64 sums of the mixed words:
    changing one word always changes both lanes, moving words changes their keys. The byte
    count is added by the caller. Deterministic across devices (integers only).

    The fused kernel computes them where it runs and passed its self-check on this device;
    else the torch ops (``reference_fingerprint``) do, with the very same result."""
    raw = _raw_bytes(t)
    usable = fingerprint_kernel.usable_on(raw.device)
    if usable and _kernel_trusted(raw.device):
        try:
            return _fingerprint(raw, fused=True)
        except Exception as e:  # passed its self-check, failed here: never trusted again
            _kernel_failed(f"raised on a tensor of {raw.numel()} bytes: {e!r}")
    if usable or raw.is_cuda:  # one the kernel would have taken
        with _kernel_lock:  # writer threads fingerprint at once: ``+=`` alone can lose counts
            _kernel["fallbacks"] += 1
    return _fingerprint(raw, fused=False)


def reference_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``device_fingerprint`` by torch ops alone: the definition the fused kernel must match."""
    return _fingerprint(_raw_bytes(t), fused=False)


def word_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be read as int32 words in place: its address and its byte
    offset in its storage (which torch's ``view`` checks: a storage imported misaligned, then
    sliced back onto a boundary, has one and not the other) both multiples of 4."""
    return t.data_ptr() % 4 == 0 and (t.storage_offset() * t.element_size()) % 4 == 0


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    raw = t.detach().reshape(-1).view(torch.uint8)
    if not word_aligned(raw):
        # A view starting off a 4-byte boundary (a bf16 slice at an odd element) cannot be
        # read as int32 words: fingerprint an aligned copy of its bytes (the same bytes, the
        # same lanes). ``CopySkipper.plan`` copies such tensors instead of paying for this.
        raw = raw.clone()
    return raw


def _fingerprint(raw: torch.Tensor, fused: bool) -> torch.Tensor:
    n = raw.numel()
    body = n - n % 4
    words = raw[:body].view(torch.int32)
    lanes = fingerprint_kernel.fused_lanes(words, 0, _LANES) if fused else _torch_lanes(words, 0)
    if lanes is None:  # never a silent torch-ops answer where the kernel was asked for
        raise RuntimeError(f"the fused kernel cannot run on {raw.device}")
    if body < n:  # 1-3 trailing bytes, one word (zero-padded; the length tells them apart)
        shifts = torch.arange(n - body, dtype=torch.int32, device=raw.device) * 8
        tail = (raw[body:].to(torch.int32) << shifts).sum(dtype=torch.int32).reshape(1)
        _mix_into(lanes, tail, body // 4)
    return lanes


def _torch_lanes(words: torch.Tensor, start: int) -> torch.Tensor:
    """The lanes of the int32 ``words`` (the first at word position ``start``) by torch ops, in
    pieces of ``_CHUNK_WORDS``: what ``fingerprint_kernel.fused_lanes`` must equal."""
    lanes = torch.zeros(len(_LANES), dtype=torch.int64, device=words.device)
    for s in range(0, words.numel(), _CHUNK_WORDS):
        _mix_into(lanes, words[s : s + _CHUNK_WORDS], start + s)
    return lanes


def _mix_into(lanes: torch.Tensor, w: torch.Tensor, start: int) -> None:
    """Add the mixed int32 words ``w`` (the first at word position ``start``) to ``lanes``.
    In place on two temporaries per piece (the ops, not the buffers, set the bits: int32
    products wrap, ``>>`` is arithmetic and the mask drops the sign's copies)."""
    pos = torch.arange(start, start + w.numel(), dtype=torch.int32, device=w.device)
    x = torch.empty_like(w)
    y = torch.empty_like(w)
    for k, (key, m1, m2) in enumerate(_LANES):
        torch.mul(pos, key, out=x)
        x.bitwise_xor_(w)
        x.mul_(m1)
        torch.bitwise_right_shift(x, 16, out=y)
        x.bitwise_xor_(y.bitwise_and_(0xFFFF))
        x.mul_(m2)
        torch.bitwise_right_shift(x, 13, out=y)
        x.bitwise_xor_(y.bitwise_and_(0x7FFFF))
        lanes[k] += x.sum(dtype=torch.int64)


# The fused kernel's standing in this process: trusted per device once its self-check there
# passed; any mismatch or error turns it off for good. ``fallbacks``: GPU tensors (or any the
# kernel would take) fingerprinted by the torch ops (no Triton, or the kernel turned off).
_kernel: dict[str, Any] = {"used": False, "reason": "not tried yet", "fallbacks": 0}
_kernel_devices: set[torch.device] = set()
_kernel_lock = threading.RLock()  # _kernel_failed takes it inside _kernel_trusted too


def kernel_state() -> dict[str, Any]:
    """Whether the fused kernel computes device fingerprints (``used``: it passed a device's
    self-check and was not turned off), why not (``reason``), and how many tensors the torch
    ops fingerprinted in its stead (``fallbacks``)."""
    if _kernel["reason"] == "not tried yet" and not fingerprint_kernel.available():
        return {**_kernel, "reason": "triton is not importable"}
    return dict(_kernel)


def prepare_fingerprint(device: torch.device) -> None:
    """Run the kernel's self-check (and its compile) on ``device`` now, if it is to run at all:
    before a save's fingerprints are timed, so ``fingerprint_pays`` weighs the kernel's reads,
    not its first compile."""
    if device.type == "cuda" and fingerprint_kernel.usable_on(device):
        _kernel_trusted(device)


def _kernel_trusted(device: torch.device) -> bool:
    if device in _kernel_devices:
        return True
    with _kernel_lock:
        if _kernel["reason"].startswith("off:"):
            return False
        if device in _kernel_devices:
            return True
        try:
            reason = _self_check(device)
        except Exception as e:
            reason = f"raised {e!r}"
        if reason is not None:
            _kernel_failed(f"self-check on {device}: {reason}")
            return False
        if _kernel["reason"].startswith("off:"):  # turned off meanwhile: stays off
            return False
        _kernel_devices.add(device)
        _kernel.update(used=True, reason="")
        return True


def _kernel_failed(reason: str) -> None:
    """Turn the kernel off for the process, said once."""
    with _kernel_lock:
        _kernel_devices.clear()
        if _kernel["reason"].startswith("off:"):
            return
        _kernel.update(used=False, reason=f"off: {reason}")
    log.warning(
        "device fingerprint: the fused kernel's fast path fell back to torch ops for good "
        "(%s); fingerprints stay exact, only slower",
        reason,
    )


def _self_check(device: torch.device) -> str | None:
    """Why the kernel cannot be trusted on ``device`` (None: it can). A probe of random bytes
    over several programs, a partial one and three trailing bytes must give the torch ops'
    lanes; so must word positions that wrap past 2**31, and words not 16-byte aligned; a bit
    flipped in the partial program must change the kernel's lanes (and still match the torch
    ops). It runs each of the kernel's compiles a tensor is likely to need."""
    per = fingerprint_kernel.WORDS_PER_PROGRAM
    g = torch.Generator().manual_seed(0x5EED)
    nbytes = 4 * (3 * per + 1000) + 3
    probe = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)
    got = _fingerprint(probe, fused=True)
    want = _fingerprint(probe, fused=False)
    if not torch.equal(got, want):
        return f"lanes {got.tolist()}, torch ops {want.tolist()}"
    words = probe[: 4 * (per + 1000)].view(torch.int32)
    start = (1 << 31) - 500  # positions wrap within the first program
    wrapped = fingerprint_kernel.fused_lanes(words, start, _LANES)
    want = _torch_lanes(words, start)
    if wrapped is None or not torch.equal(wrapped, want):
        return f"lanes {wrapped} at wrapping positions, torch ops {want.tolist()}"
    # Words 4 bytes past a 16-byte boundary: the kernel's other compile (scalar loads).
    unaligned = fingerprint_kernel.fused_lanes(words[1:], 1, _LANES)
    want = _torch_lanes(words[1:], 1)
    if unaligned is None or not torch.equal(unaligned, want):
        return f"lanes {unaligned} of unaligned words, torch ops {want.tolist()}"
    probe[4 * (3 * per + 500) + 1] ^= 1 << 5
    flipped = _fingerprint(probe, fused=True)
    if torch.equal(flipped, got):
        return "a flipped bit left the lanes unchanged"
    if not torch.equal(flipped, _fingerprint(probe, fused=False)):
        return "lanes of the flipped probe differ from the torch ops'"
    return None


@dataclass
class SkipPlan:
    """One save's decisions for one slot: what is skipped, what is recorded once copied."""

    skip: frozenset[int] = frozenset()
    hash_after: list[int] = field(default_factory=list)  # CPU: fingerprint the slot's bytes
    cuda_record: dict[int, bytes] = field(default_factory=dict)  # GPU: the source's, pre-copy
    skipped_bytes: int = 0
    fingerprint_seconds: float = 0.0
    check_seconds: float = 0.0  # the compare of the bytes after an overlapped copy (bytecheck.py)
    fallbacks: int = 0
    # Large CPU tensors: xxh3-128 of the bytes the slot holds once staged, the very digest the
    # worker's file fingerprint takes of them (``worker_digests``: it need not hash them again).
    # GPU tensors' device fingerprints are another hash: the worker hashes those itself.
    digests: dict[int, bytes] = field(default_factory=dict)
    device_bytes: int = 0  # fingerprinted on a GPU, and the seconds it took (its own work)
    device_seconds: float = 0.0


class CopySkipper:
    """One engine's copy skipping (``Staging(differential=)``): the marks of the last save
    staged (the pre-filter) and the fingerprint decisions; the slots keep what they hold."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._last: tuple[Any, Marks] | None = None  # (layout key, marks) of the last save
        self.on_device = True  # GPU tensors fingerprinted (off once it costs more: ``weigh``)

    def warm(self, tensors: dict[str, torch.Tensor]) -> None:
        """At ``prepare``: the fused kernel's compile and self-check on each GPU the state is
        on, so that the first save's stall does not pay for them (seconds on a fresh machine)."""
        if self.enabled and self.on_device:
            for device in {t.device for t in tensors.values() if t.is_cuda}:
                prepare_fingerprint(device)

    def plan(
        self,
        slot: StagingSlot,
        tensors: dict[str, torch.Tensor],
        marks: Marks,
        ready: dict[int, Any] | None = None,
    ) -> SkipPlan:
        """Decide, for the large tensors of ``slot``, which need no copy. Drops the slot's
        record of every tensor that will be copied (before its view is overwritten)."""
        plan = SkipPlan()
        if not self.enabled or not slot.large:
            slot.held.clear()
            return plan
        t0 = time.perf_counter()
        srcs = list(tensors.values())
        last = self._last
        prev = last[1] if last is not None and same_key(last[0], slot.key) else None
        cpu: list[tuple[int, Any, bytes]] = []  # (index, source bytes, what the slot holds)
        cuda: list[tuple[int, torch.Tensor, bytes | None]] = []
        for i in slot.large:
            held = slot.held.pop(i, None)
            if prev is not None and _moved(prev, marks, i):
                continue  # written in place since the last save: copied, no fingerprint
            t = srcs[i]
            if t.data_ptr() != marks.pointers[i]:
                # Moved since save() was called (a storage freed or swapped while an overlapped
                # save waited): never read; the copy's own check fails the save as torn.
                continue
            if t.is_cuda:
                # Off a 4-byte boundary (a bf16 slice at an odd element): not read as words
                # in place, so copied, never skipped (counted).
                if t.is_contiguous() and self.on_device and word_aligned(t):
                    cuda.append((i, t, held))
                else:
                    plan.fallbacks += 1
                continue
            src = _as_bytes(t)
            if src is None:
                plan.fallbacks += 1  # strided, conjugate: copied by torch, never skipped
            elif held is None:
                plan.hash_after.append(i)  # nothing to compare with: copied, then recorded
            else:
                cpu.append((i, src, held))
        skip = set()
        if cpu:
            digests = _map(lambda e: fingerprint_bytes(e[1]), cpu)
            for (i, _, held), digest in zip(cpu, digests, strict=True):
                if digest == held:
                    skip.add(i)
                    slot.held[i] = held  # still holds it: nothing writes that view
                    plan.digests[i] = held
                else:
                    plan.hash_after.append(i)
        if cuda:
            fps, plan.device_seconds = _cuda_fingerprints([(i, t) for i, t, _ in cuda], ready)
            plan.device_bytes = sum(slot.specs[i].nbytes for i, _, _ in cuda)
            for i, _, held in cuda:
                digest = fps[i]
                if held == digest:
                    skip.add(i)
                    slot.held[i] = digest
                else:
                    plan.cuda_record[i] = digest
        plan.skip = frozenset(skip)
        plan.skipped_bytes = sum(slot.specs[i].nbytes for i in skip)
        plan.fingerprint_seconds = time.perf_counter() - t0
        return plan

    def settle(self, slot: StagingSlot, plan: SkipPlan, marks: Marks) -> float:
        """After an untorn copy: record what the slot now holds; returns the seconds spent."""
        t0 = time.perf_counter()
        if plan.hash_after:
            digests = _map(lambda i: fingerprint_bytes(slot.dst_bytes[i]), plan.hash_after)
            slot.held.update(zip(plan.hash_after, digests, strict=True))
            plan.digests.update(zip(plan.hash_after, digests, strict=True))
        slot.held.update(plan.cuda_record)
        self._last = (slot.key, marks)
        return time.perf_counter() - t0

    def weigh(self, plan: SkipPlan, copied_bytes: int, copy_seconds: float) -> None:
        """After a save's copy: stop fingerprinting GPU tensors where it cost more per byte
        than the copy (the slots forget their GPU records: nothing is skipped from them)."""
        if not self.on_device or not plan.device_bytes:
            return
        pays = fingerprint_pays(plan.device_bytes, plan.device_seconds, copied_bytes, copy_seconds)
        if pays is not False:
            return
        self.on_device = False
        plan.cuda_record.clear()
        log.warning(
            "differential copies: fingerprinting on the GPU read %.1f GB/s, the copy moved "
            "%.1f GB/s: GPU tensors are copied without fingerprints from now on "
            "(SaveStats.copy_skip_fallbacks counts them)",
            plan.device_bytes / plan.device_seconds / 1e9,
            copied_bytes / copy_seconds / 1e9,
        )


def _moved(prev: Marks, now: Marks, i: int) -> bool:
    if prev.versions and now.versions and prev.versions[i] != now.versions[i]:
        return True
    return prev.pointers[i] != now.pointers[i]


def _map(fn: Callable[[Any], bytes], items: list[Any]) -> list[bytes]:
    """``fn`` over ``items`` on the copy pool (xxhash releases the GIL on large inputs)."""
    threads = cpu_copy_threads()
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    return list(_pool(threads).map(fn, items))


def _cuda_fingerprints(
    items: list[tuple[int, torch.Tensor]], ready: dict[int, Any] | None
) -> tuple[dict[int, bytes], float]:
    """``device_fingerprint`` of each tensor on its device's copy stream (so the D2H copies
    that follow queue after it and the values are the ``save`` call's); one sync per device.
    Also the seconds the fingerprints took, not counting the wait for the trainer's queued work
    (the copy waits for that in any case)."""
    seconds = 0.0
    by_device: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for i, t in items:
        by_device.setdefault(t.device.index or 0, []).append((i, t))
    out: dict[int, bytes] = {}
    for dev, its in by_device.items():
        with torch.cuda.device(dev):
            stream = side_stream(dev, ready)
            stream.synchronize()  # the values to save are computed: time the fingerprint alone
            with torch.cuda.stream(stream):
                prepare_fingerprint(torch.device("cuda", dev))  # not timed: once per device
                t0 = time.perf_counter()
                lanes = torch.stack([device_fingerprint(t) for _, t in its])
                host = lanes.cpu()  # on the copy stream: waits for it, not for the device
            seconds += time.perf_counter() - t0
        for (i, t), row in zip(its, host, strict=True):
            size = t.numel() * t.element_size()
            out[i] = row.numpy().tobytes() + size.to_bytes(8, "little")
    return out, seconds


def stage_checked(
    skipper: CopySkipper | None,
    slot: StagingSlot,
    tensors: dict[str, torch.Tensor],
    marks: Marks,
    guard: bool,
    pin: bool,
    ready: dict[int, Any] | None = None,
    check_bytes: bool = False,
) -> tuple[StateModifiedWhileStaging | None, SkipPlan]:
    """``copy_checked`` and the torn check after it, skipping what ``slot`` holds already:
    the torn state (or None) and the plan (its figures for ``SaveStats``). ``check_bytes``:
    then compare the CPU tensors' bytes with the staged ones (an overlapped save: the loop
    ran during the copy; bytecheck.py), the seconds in ``plan.check_seconds``."""
    plan = skipper.plan(slot, tensors, marks, ready) if skipper is not None else SkipPlan()
    t0 = time.perf_counter()
    try:
        torn = copy_checked(slot, tensors, marks, guard, pin, ready, skip=plan.skip)
    except BaseException:
        slot.held.clear()  # a copy that stopped midway: the views hold who knows what
        raise
    if torn is None:
        torn = torn_since(tensors, marks)
    if torn is None and check_bytes:
        t1 = time.perf_counter()
        try:
            unseen = changed_since_copied(slot, tensors, marks)
        except StateModifiedWhileStaging as e:  # a storage freed or replaced: never read
            unseen, torn = [], e
        plan.check_seconds = time.perf_counter() - t1
        if unseen:
            # A write the counters do see may have landed since torn_since: named as such.
            torn = torn_since(tensors, marks) or StateModifiedWhileStaging(unseen, unseen=unseen)
    if torn is not None:
        # The copied views may hold two moments; skipped views were not written (kept).
        return torn, plan
    if skipper is not None and skipper.enabled:
        if plan.device_bytes:  # (only a save that fingerprinted on a GPU is weighed)
            copied = sum(spec.nbytes for spec in slot.specs) - plan.skipped_bytes
            skipper.weigh(plan, copied, time.perf_counter() - t0)
        plan.fingerprint_seconds += skipper.settle(slot, plan, marks)
    return None, plan


def worker_digests(slot: StagingSlot, plan: SkipPlan) -> dict[str, bytes]:
    """What the job tells the worker (``SaveJob.digests``): staged key -> xxh3-128 of the bytes
    its view holds, for the large CPU tensors of an untorn save. Only the bytes' digest, never
    "unchanged": the worker still compares each file with the last checkpoint it *wrote*,
    which may be another slot's (slots alternate) or older than this slot's last save."""
    return {slot.specs[i].fqn: d for i, d in plan.digests.items()}


def note_skips(stats: Any, plan: SkipPlan) -> None:
    """A save's copy-skipping figures into its ``SaveStats``."""
    stats.copy_skipped_bytes = plan.skipped_bytes
    stats.copy_fingerprint_seconds = plan.fingerprint_seconds
    stats.copy_check_seconds = plan.check_seconds
    stats.copy_skip_fallbacks = plan.fallbacks
