"""The device fingerprint's fused kernel (Triton, optional): ``unchanged.device_fingerprint``'s
two lanes over a tensor's 32-bit words in one pass, without its torch ops' temporaries.

The torch ops in ``unchanged.py`` are the reference: this kernel must give the same lanes, bit
for bit, and ``unchanged`` checks that on each device before trusting it (a self-check; it falls
back to the torch ops if anything differs). Without Triton, or for a tensor that is not on a
GPU, ``fused_lanes`` answers None and the torch ops are used.

Per word ``w`` at word position ``p`` (int32, wrapping) and lane ``(key, m1, m2)``, all int32
wrapping arithmetic: ``x = (w ^ p*key) * m1; x ^= (x >> 16) & 0xFFFF; x *= m2;
x ^= (x >> 13) & 0x7FFFF``; a lane is the int64 sum of its ``x``. Each program sums its words
per lane into int64 and writes one partial row; torch sums the rows (integers: exact, in any
order, so no atomics and the same answer every run). Whole programs run unmasked, so their
loads can be vectorised; the partial one, if any, is a second launch with a mask.

Tests run it on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
Triton is imported); only then are CPU tensors taken.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

#: Words per program and loop step; each program reads ``WORDS_PER_PROGRAM`` (64 KiB), so an
#: 8 GiB tensor writes 2 MiB of partial sums.
BLOCK = 1024
ITERS = 16
WORDS_PER_PROGRAM = BLOCK * ITERS
_NUM_WARPS = 4


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (tests): read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, or None where Triton cannot be imported (imported on first use: an
    import of asyncckpt never pays for Triton's)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or broken: the torch ops do the work
        return None

    # Launched twice per tensor: its whole programs unmasked (vector loads), then its partial
    # one masked. The ints vary per tensor: not specialised on their values (a compile per new
    # value would land in the timed fingerprint: unchanged.prepare_fingerprint).
    @triton.jit(do_not_specialize=["first", "rem", "start"])
    def lanes_kernel(
        words_ptr,
        out_ptr,
        first,
        rem,
        start,
        K0: tl.constexpr,
        A0: tl.constexpr,
        B0: tl.constexpr,
        K1: tl.constexpr,
        A1: tl.constexpr,
        B1: tl.constexpr,
        BLOCK: tl.constexpr,
        ITERS: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        # Every int32 product and sum here is written sanitize_overflow=False: the mix wraps on
        # purpose, and in Triton's debug mode (TRITON_DEBUG=1) each would otherwise get an
        # overflow assert, and a device-side assert breaks the process's CUDA context.
        pid = tl.add(tl.program_id(0), first, sanitize_overflow=False)
        # int64 base: a tensor may hold more than 2**31 words; int32 offsets within a program.
        base = pid.to(tl.int64) * (BLOCK * ITERS)
        ptr = words_ptr + base
        # int64 -> int32 truncates, and int32 adds wrap: positions wrap past 2**31 exactly as
        # torch.arange(dtype=torch.int32) does.
        p0 = (base + start).to(tl.int32)
        acc0 = tl.zeros([BLOCK], dtype=tl.int64)
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        for i in range(ITERS):
            j = tl.add(
                tl.mul(i, BLOCK, sanitize_overflow=False),
                tl.arange(0, BLOCK),
                sanitize_overflow=False,
            )
            if MASKED:
                w = tl.load(ptr + j, mask=j < rem, other=0)
            else:
                w = tl.load(ptr + j)
            p = tl.add(p0, j, sanitize_overflow=False)
            # Constants below 2**31 are int32 to Triton, so every product wraps in int32.
            # Arithmetic shift then mask: the torch code's exact bits.
            x = tl.mul(w ^ tl.mul(p, K0, sanitize_overflow=False), A0, sanitize_overflow=False)
            x = x ^ ((x >> 16) & 0xFFFF)
            x = tl.mul(x, B0, sanitize_overflow=False)
            x = x ^ ((x >> 13) & 0x7FFFF)
            y = tl.mul(w ^ tl.mul(p, K1, sanitize_overflow=False), A1, sanitize_overflow=False)
            y = y ^ ((y >> 16) & 0xFFFF)
            y = tl.mul(y, B1, sanitize_overflow=False)
            y = y ^ ((y >> 13) & 0x7FFFF)
            if MASKED:  # words past the end add nothing
                x = tl.where(j < rem, x, 0)
                y = tl.where(j < rem, y, 0)
            acc0 = tl.add(acc0, x.to(tl.int64), sanitize_overflow=False)
            acc1 = tl.add(acc1, y.to(tl.int64), sanitize_overflow=False)
        row = out_ptr + tl.mul(pid.to(tl.int64), 2, sanitize_overflow=False)
        tl.store(row, tl.sum(acc0, axis=0))
        tl.store(row + 1, tl.sum(acc1, axis=0))

    return lanes_kernel


def available() -> bool:
    """Whether Triton can be imported (the kernel can be built)."""
    return _kernel() is not None


def usable_on(device: torch.device) -> bool:
    """Whether ``fused_lanes`` takes tensors on ``device``: a GPU, or any under the interpreter."""
    return (device.type == "cuda" or interpreting()) and available()


def fused_lanes(
    words: torch.Tensor, start: int, lanes: tuple[tuple[int, int, int], ...]
) -> torch.Tensor | None:
    """The two int64 lanes of ``words`` (contiguous 1-d int32, the first at word position
    ``start``) on their device, or None where the kernel cannot run (no Triton, not a GPU
    tensor). ``lanes``: the two (key, m1, m2) of ``unchanged._LANES``."""
    kernel = _kernel()
    if kernel is None or not usable_on(words.device):
        return None
    if words.dtype != torch.int32 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError("fused_lanes takes a contiguous 1-d int32 tensor")
    if len(lanes) != 2 or not all(0 <= c < 1 << 31 for lane in lanes for c in lane):
        # Two lanes, and constants Triton types as int32 (larger ones would not wrap in int32).
        raise ValueError("fused_lanes takes two lanes of int32 constants")
    n = words.numel()
    if n == 0:  # no launch over an empty (possibly null) pointer
        return torch.zeros(2, dtype=torch.int64, device=words.device)
    full, rem = divmod(n, WORDS_PER_PROGRAM)
    partial = torch.empty((full + (rem > 0), 2), dtype=torch.int64, device=words.device)
    (k0, a0, b0), (k1, a1, b1) = lanes
    consts = dict(K0=k0, A0=a0, B0=b0, K1=k1, A1=a1, B1=b1, BLOCK=BLOCK, ITERS=ITERS)
    # Triton launches on the current device: make it the tensor's.
    guard = torch.cuda.device(words.device) if words.is_cuda else contextlib.nullcontext()
    with guard:
        if full:
            kernel[(full,)](
                words, partial, 0, 0, start, **consts, MASKED=False, num_warps=_NUM_WARPS
            )
        if rem:
            kernel[(1,)](
                words, partial, full, rem, start, **consts, MASKED=True, num_warps=_NUM_WARPS
            )
    return partial.sum(dim=0)
