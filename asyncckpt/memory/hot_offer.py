"""A hot resume's offer (hot_serve.py makes it, hot_resume.py takes it) and its form on the socket.

On the socket an offer is a fixed header (``HEADER``: the magic ``MAGIC``, which names this
format and its version, and the length of what follows), then the offer as JSON
(``encode_offer``); the arenas' descriptors travel with the header's bytes (``SCM_RIGHTS``).
Never a pickle: the socket's name is public on the node (an abstract Unix socket), and
although both sides check that the other runs as the same user, what they exchange is data.

The client decodes it with ``decode_offer``: the exact keys and types, every tensor inside
its arena, one descriptor per arena, each staged tensor's dtype from ``DTYPES`` and its size
what its shape says, objects as base64, object paths of the two kinds DCP's flattening makes,
the old run's side store as ``dist.DistConfig``'s fields. Anything else raises
``peerdata.Malformed``, and the load reads the disk as after any other refusal.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncckpt.cluster.dist import DistConfig
from asyncckpt.cluster.peerdata import (
    DTYPE_NAMES,
    DTYPES,
    Malformed,
    Reader,
    dumps,
    encode_blob,
    loads,
)

__all__ = ["DTYPES", "HEADER", "MAGIC", "MAX_OFFER_BYTES", "Offer", "decode_offer", "encode_offer"]

#: An offer's first bytes: ``MAGIC``, then the length of the JSON that follows.
HEADER = struct.Struct("<8sQ")
#: This format, version 1 (a worker of an earlier asyncckpt sent a pickle: refused).
MAGIC = b"ACKHOT01"
#: The longest offer a client reads (a large state's objects and object paths fit).
MAX_OFFER_BYTES = 1 << 30


@dataclass
class Offer:
    """A step a surviving worker holds: what a new engine needs to map and find its bytes."""

    step: int
    rank: int
    files: tuple[str, ...]  # the files this rank wrote for the step (their records hold it)
    tensors: dict[str, tuple[int, int, int]]  # DCP key -> (arena index, byte offset, nbytes)
    sizes: tuple[int, ...]  # each arena's bytes (one descriptor each, in this order)
    pid: int
    # Offered before it is written (``offer_staged``): each tensor's (dtype, shape, CRC-32C)
    # from the staged memory, the objects (torch.save bytes) and the paths to unflatten the
    # flat keys: a load needs no file. None: a committed step (its files say the rest).
    staged: dict[str, tuple[torch.dtype, tuple[int, ...], int]] | None = None
    objects: dict[str, bytes] | None = None
    paths: dict[str, list] | None = None
    # Several ranks: the old run's side store (``dist.DistConfig``, served by its rank 0's
    # worker until its offer is read), where the new ranks agree on taking a step offered
    # before it was written (hot_resume.py ``EarlyVote``); set on every offer made once the trainer
    # died, so that a rank whose early offer was withdrawn says no there.
    vote: Any = None
    # The ranks of the run that made it: its memory is one rank's part of a step of that
    # many, which a run of another size cannot take as its own rank's (hot_resume.py).
    world_size: int = 1


_KEYS = (
    "v", "step", "rank", "files", "tensors", "sizes", "pid", "staged", "objects", "paths", "vote",
    "world_size",
)  # fmt: skip


def encode_offer(offer: Offer) -> bytes:
    """``offer`` as its JSON; ``ValueError`` if it holds what has no form there (a dtype
    outside ``DTYPES``, a vote that is not a ``DistConfig``)."""
    staged = None
    if offer.staged is not None:
        staged = {}
        for fqn, (dtype, shape, crc) in offer.staged.items():
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"{fqn}: dtype {dtype} cannot be offered")
            staged[fqn] = [DTYPE_NAMES[dtype], list(shape), crc]
    if offer.vote is not None and not isinstance(offer.vote, DistConfig):
        raise ValueError(f"the offer's vote is a {type(offer.vote).__name__}, not a DistConfig")
    return dumps(
        {
            "v": 1,
            "step": offer.step,
            "rank": offer.rank,
            "files": list(offer.files),
            "tensors": {k: list(where) for k, where in offer.tensors.items()},
            "sizes": list(offer.sizes),
            "pid": offer.pid,
            "staged": staged,
            "objects": _maybe(offer.objects, lambda o: {k: encode_blob(b) for k, b in o.items()}),
            "paths": _maybe(offer.paths, lambda p: {k: [list(i) for i in v] for k, v in p.items()}),
            "vote": _maybe(offer.vote, _encode_vote),
            "world_size": offer.world_size,
        }
    )


def decode_offer(raw: bytes, descriptors: int) -> Offer:
    """The offer ``encode_offer`` wrote, which came with ``descriptors`` file descriptors;
    else ``peerdata.Malformed``, saying what is wrong where."""
    what = "the surviving worker's offer"
    r = Reader(what)
    v = r.record(loads(raw, what, MAX_OFFER_BYTES), "", _KEYS)
    if v["v"] != 1:
        r.fail("v", f"format version {v['v']!r}; this asyncckpt reads version 1")
    sizes = tuple(r.items(v["sizes"], "sizes", r.integer))
    if len(sizes) != descriptors:
        r.fail("sizes", f"{len(sizes)} arena(s) but {descriptors} descriptor(s) came with it")
    tensors = r.by_name(v["tensors"], "tensors", lambda x, at: _place(r, x, at, sizes))
    staged = None
    if v["staged"] is not None:
        staged = r.by_name(v["staged"], "staged", _staged(r))
        if staged.keys() != tensors.keys():
            r.fail("staged", "its keys are not the tensors' keys")
        for fqn, (dtype, shape, _) in staged.items():
            want = math.prod(shape) * dtype.itemsize
            if want != tensors[fqn][2]:
                r.fail(f"staged[{fqn!r}]", f"{want} bytes by its shape, {tensors[fqn][2]} placed")
    return Offer(
        r.integer(v["step"], "step"),
        r.integer(v["rank"], "rank"),
        tuple(r.items(v["files"], "files", r.text)),
        tensors,
        sizes,
        r.integer(v["pid"], "pid"),
        staged,
        _maybe(v["objects"], lambda o: r.by_name(o, "objects", r.blob)),
        _maybe(v["paths"], lambda p: r.by_name(p, "paths", _path(r))),
        _maybe(v["vote"], lambda x: _decode_vote(r, x, "vote")),
        r.integer(v["world_size"], "world_size", 1),
    )


def _maybe(v: Any, f: Callable[[Any], Any]) -> Any:
    return None if v is None else f(v)


def _place(r: Reader, v: Any, at: str, sizes: tuple[int, ...]) -> tuple[int, int, int]:
    """A tensor's (arena, offset, nbytes), lying inside an arena that came."""
    parts = r.items(v, at, r.integer)
    if len(parts) != 3:
        r.fail(at, f"expected [arena, offset, nbytes], got {len(parts)} item(s)")
    arena, offset, n = parts
    if arena >= len(sizes):
        r.fail(at, f"arena {arena} of {len(sizes)}")
    if offset + n > sizes[arena]:
        r.fail(at, f"bytes [{offset}, {offset + n}) past the end of arena {arena} ({sizes[arena]})")
    return arena, offset, n


def _staged(r: Reader) -> Callable[[Any, str], tuple[torch.dtype, tuple[int, ...], int]]:
    def one(v: Any, at: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        parts = r.items(v, at, lambda x, _: x)
        if len(parts) != 3:
            r.fail(at, f"expected [dtype, shape, crc], got {len(parts)} item(s)")
        name = r.text(parts[0], f"{at}[0]")
        if name not in DTYPES:
            r.fail(f"{at}[0]", f"dtype {name[:40]!r} is none this asyncckpt offers")
        shape = tuple(r.items(parts[1], f"{at}[1]", r.integer))
        return DTYPES[name], shape, r.crc(parts[2], f"{at}[2]")

    return one


def _path(r: Reader) -> Callable[[Any, str], list[tuple[str, str | int]]]:
    """A key's path in the nested state: ["d", str or int key] or ["l", list index] each."""

    def item(v: Any, at: str) -> tuple[str, str | int]:
        parts = r.items(v, at, lambda x, _: x)
        if len(parts) != 2 or parts[0] not in ("d", "l"):
            r.fail(at, 'expected ["d", key] or ["l", index]')
        kind, key = parts
        if kind == "l":
            return "l", r.integer(key, f"{at}[1]")
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            r.fail(f"{at}[1]", "a key that is neither a string nor an integer")
        return "d", key

    return lambda v, at: r.items(v, at, item)


def _encode_vote(cfg: DistConfig) -> dict[str, Any]:
    # With the secret: the new engines sign their words in the old run's side store with it
    # (hot_agree.py). The socket carries it only to a process of this user (SO_PEERCRED).
    out = dataclasses.asdict(cfg)
    return {k: encode_blob(x) if isinstance(x, bytes) else x for k, x in out.items()}


def _decode_vote(r: Reader, v: Any, at: str) -> DistConfig:
    """The old run's side store: ``DistConfig``'s fields, each of its declared type."""
    hints = typing.get_type_hints(DistConfig)
    fields = [f.name for f in dataclasses.fields(DistConfig)]
    got = r.record(v, at, fields)
    return DistConfig(**{k: _typed(r, hints[k])(got[k], f"{at}.{k}") for k in fields})


def _typed(r: Reader, tp: Any) -> Callable[[Any, str], Any]:
    """The decoder of a ``DistConfig`` field of type ``tp``."""
    plain: dict[Any, Callable[[Any, str], Any]] = {
        int: r.integer,
        float: r.number,
        str: r.text,
        bool: r.flag,
        bytes: r.blob,
    }
    if tp in plain:
        return plain[tp]
    args = typing.get_args(tp)
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if union and len(args) == 2 and type(None) in args:
        inner = _typed(r, next(a for a in args if a is not type(None)))
        return lambda x, at: None if x is None else inner(x, at)
    raise Malformed(f"DistConfig has a field of type {tp}, which an offer cannot carry")
