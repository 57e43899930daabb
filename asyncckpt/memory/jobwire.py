"""A memory save's job on the wire (``MemoryTier(replicas=1)``, replication.py): the header
of a replica, field by field, as plain JSON data and byte segments (framing.py), never a
pickle. Decoding checks every field's type and every size before the receiver allocates for
it, and builds the ``SaveJob`` a stand-in writes as the sender's rank would.

What travels, per ``SaveJob`` field:

- ``job_id``, ``step``, ``attempt``, ``tier``, ``persisted_because``, ``memory_job_id``,
  ``saved_at``, ``metrics``, ``metadata``, ``figures``: plain data, as they are.
- ``specs``: each tensor's name, arena, offset, size and shape, its dtype by name from
  ``DTYPES`` (a dtype outside it is refused on the sender); checked on the receiver to lie in
  the arenas it is sent and to be as large as its shape says.
- ``objects`` (``torch.save`` bytes the trainer made, written as they are): byte segments.
- ``paths``: each key's path, ``[["d", key], ["l", index], ...]``.
- ``extra``, the format's part of the job, key by key (``_EXTRA_KEYS``): DCP's and
  torch_dist's shard layout, torch_dist's ``common`` bytes, megatron_legacy's ranks, a
  components spec (its components' formats checked as when it was made) and what it adds to
  the manifest. A key not listed is refused on the sender (a format whose extra has no wire
  form here is not replicated, saying so), as is:

  - a format the user registered (``extra[FORMAT_KEY]``, a Python object): it cannot travel
    as data, and a receiver could not write it with a format it does not have;
  - a skeleton to unpickle (formats ``pt`` and ``megatron_legacy`` writing their file): the
    stand-in would unpickle bytes that came from a socket.

  Either way the memory save itself stands; ``handle.replicated()`` raises ``NotReplicated``
  with the reason.

What does not travel, and what the receiver does instead:

- ``prune`` (the user's retention policy, an object): the replica's job prunes nothing. A
  stand-in's commit at the trainers' death leaves every older step; the next save prunes.
- ``digests`` (the trainer's fingerprints of the staged bytes, used by differential saves in
  place of hashing them again): a stand-in hashes the bytes it holds (never a peer's word for
  which bytes are unchanged).
- ``arena_ids`` (renumbered by the receiver), ``faults`` (a test's, never armed on a peer),
  ``held_as`` (a slot of the sender's memory). ``chunks``: memory saves are never staged in
  chunks; one that is, is refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from asyncckpt.cluster.framing import Message, ProtocolError
from asyncckpt.cluster.peerdata import DTYPE_NAMES, DTYPES
from asyncckpt.core.savejob import SaveJob, TensorSpec
from asyncckpt.core.shards import ShardInfo
from asyncckpt.formats import FORMAT_KEY
from asyncckpt.formats.base import LegacyRanks
from asyncckpt.formats.components import Component

__all__ = ["DTYPES", "NotReplicable", "decode_replica", "encode_replica"]

#: The most arenas one replica has (a slot is a few arenas of up to 2 GiB each).
MAX_ARENAS = 1 << 16


class NotReplicable(ValueError):
    """A memory save that cannot travel to a peer as data (said on ``handle.replicated()``)."""


# ------------------------------------------------------------------ the sender's side


class _Segments:
    """The byte segments that travel after a header; a header names one by its index."""

    def __init__(self) -> None:
        self.items: list[bytes] = []

    def add(self, data: bytes) -> int:
        if not isinstance(data, bytes):
            raise NotReplicable(f"expected bytes, got {type(data).__name__}")
        self.items.append(data)
        return len(self.items) - 1


def encode_replica(
    job: SaveJob, specs: list[TensorSpec], sizes: list[int], keep: list[int]
) -> tuple[dict[str, Any], list[bytes]]:
    """The ``"replica"`` message for ``job`` (its arenas ``sizes`` bytes each, their tensors
    ``specs``; ``keep``: the other steps the sender still holds). NotReplicable if part of it
    cannot travel as data."""
    if job.chunks is not None:
        raise NotReplicable("a save staged in chunks is not replicated")
    segs = _Segments()
    body = {
        "job_id": job.job_id,
        "step": job.step,
        "attempt": job.attempt,
        "tier": job.tier,
        "persisted_because": job.persisted_because,
        "memory_job_id": job.memory_job_id,
        "saved_at": job.saved_at,
        "metrics": {k: float(v) for k, v in job.metrics.items()},
        "metadata": job.metadata,
        "figures": dict(job.figures),
        "specs": [_spec_out(s) for s in specs],
        "objects": {k: segs.add(v) for k, v in job.objects.items()},
        "paths": None if job.paths is None else {k: _path_out(p) for k, p in job.paths.items()},
        "extra": None if job.extra is None else _extra_out(job.extra, segs),
    }
    header = {"kind": "replica", "job": body, "sizes": list(sizes), "keep": list(keep)}
    return header, segs.items


def _spec_out(s: TensorSpec) -> dict[str, Any]:
    name = DTYPE_NAMES.get(s.dtype)
    if name is None:
        raise NotReplicable(f"tensor {s.fqn!r} is of dtype {s.dtype}, which replicas do not carry")
    return {
        "fqn": s.fqn,
        "arena": s.arena,
        "offset": s.offset,
        "nbytes": s.nbytes,
        "dtype": name,
        "shape": list(s.shape),
    }


def _path_out(path: list) -> list[list[Any]]:
    return [[kind, key] for kind, key in path]


def _extra_out(extra: Mapping[str, Any], segs: _Segments) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in extra.items():
        if key == FORMAT_KEY:
            raise NotReplicable(
                f"its format {getattr(value, 'name', value)!r} was registered by the user: a "
                "Python object, which does not travel to a peer (save it in a built-in format "
                "to replicate it)"
            )
        codec = _EXTRA_KEYS.get(key)
        if codec is None:
            raise NotReplicable(f"the format's {key!r} has no wire form")
        out[key] = codec[0](value, segs)
    return out


def _shards_out(shards: Mapping[str, tuple[ShardInfo, list[str]]], _: _Segments) -> Any:
    return {
        k: {
            "global_shape": list(info.global_shape),
            "chunks": [[list(off), list(size)] for off, size in info.chunks],
            "keys": list(keys),
        }
        for k, (info, keys) in shards.items()
    }


def _skeleton_out(skeleton: bytes | None, segs: _Segments) -> Any:
    if skeleton:
        raise NotReplicable(
            "its format (pt, megatron_legacy) hands the worker a pickled skeleton, which a "
            "peer would unpickle: memory saves in it are not replicated"
        )
    return None if skeleton is None else segs.add(b"")


def _components_out(parts: list[tuple[str, Component, Any]], segs: _Segments) -> Any:
    return [
        {"name": name, "component": c.to_json(), "extra": _extra_out(part, segs)}
        for name, c, part in parts
    ]


# ------------------------------------------------------------------ the receiver's side


class _Reader:
    """Reads one header's fields, each checked; names the field in what it raises."""

    def __init__(self, segments: list[bytes]) -> None:
        self.segments = segments
        self.used: set[int] = set()

    def segment(self, v: Any, what: str) -> bytes:
        i = _int(v, what)
        if i >= len(self.segments) or i in self.used:
            raise ProtocolError(f"{what}: no segment {i}, or one named twice")
        self.used.add(i)
        return self.segments[i]


def decode_replica(msg: Message) -> tuple[SaveJob, list[int], list[int]]:
    """The job, arena sizes and kept steps of a ``"replica"`` message, every field checked
    (ProtocolError). The job's ``arena_ids`` are the receiver's to set."""
    h = msg.header
    sizes = _list(h.get("sizes"), "sizes", lambda v, w: _int(v, w), limit=MAX_ARENAS)
    keep = _list(h.get("keep"), "keep", lambda v, w: _int(v, w))
    body = _dict(h.get("job"), "job")
    r = _Reader(msg.segments)
    extra = body.get("extra")
    job = SaveJob(
        job_id=_int(body.get("job_id"), "job_id"),
        step=_int(body.get("step"), "step"),
        arena_ids=[],
        specs=_list(body.get("specs"), "specs", lambda v, w: _spec_in(v, w, sizes)),
        objects={
            k: r.segment(v, f"objects[{k!r}]")
            for k, v in _dict(body.get("objects"), "objects").items()
        },
        paths=None if body.get("paths") is None else _paths_in(body["paths"]),
        metrics={
            k: _number(v, f"metrics[{k!r}]")
            for k, v in _dict(body.get("metrics"), "metrics").items()
        },
        metadata=_dict(body.get("metadata"), "metadata"),
        prune=None,
        extra=None if extra is None else _extra_in(extra, r, "extra"),
        attempt=_int(body.get("attempt"), "attempt"),
        figures={
            k: None if v is None else _number(v, f"figures[{k!r}]")
            for k, v in _dict(body.get("figures"), "figures").items()
        },
        saved_at=_optional(body.get("saved_at"), "saved_at", _number),
        tier=_choice(body.get("tier"), "tier", ("memory",)),  # (only memory saves travel)
        persisted_because=_optional(body.get("persisted_because"), "persisted_because", _str),
        memory_job_id=_optional(body.get("memory_job_id"), "memory_job_id", _int),
    )
    if len(r.used) != len(msg.segments):
        raise ProtocolError("a replica with byte segments its header does not name")
    return job, sizes, keep


def _spec_in(v: Any, what: str, sizes: list[int]) -> TensorSpec:
    d = _dict(v, what)
    name = _str(d.get("dtype"), f"{what}.dtype")
    if name not in DTYPES:
        raise ProtocolError(f"{what}: dtype {name!r} is not one replicas carry")
    dtype = DTYPES[name]
    shape = tuple(_list(d.get("shape"), f"{what}.shape", lambda x, w: _int(x, w), limit=64))
    spec = TensorSpec(
        fqn=_str(d.get("fqn"), f"{what}.fqn"),
        arena=_int(d.get("arena"), f"{what}.arena"),
        offset=_int(d.get("offset"), f"{what}.offset"),
        nbytes=_int(d.get("nbytes"), f"{what}.nbytes"),
        dtype=dtype,
        shape=shape,
    )
    if spec.arena >= len(sizes) or spec.offset + spec.nbytes > sizes[spec.arena]:
        raise ProtocolError(f"{what} ({spec.fqn!r}) lies outside the arenas sent")
    if spec.nbytes != math.prod(shape) * dtype.itemsize:
        raise ProtocolError(f"{what} ({spec.fqn!r}): {spec.nbytes} bytes for shape {shape}")
    return spec


def _paths_in(v: Any) -> dict[str, list]:
    def item(x: Any, what: str) -> tuple[str, Any]:
        pair = _list(x, what, lambda y, w: y, limit=2)
        if len(pair) != 2 or pair[0] not in ("d", "l"):
            raise ProtocolError(f"{what}: not a path step")
        kind, key = pair
        if kind == "l":
            key = _int(key, what)  # a list's index
        elif not isinstance(key, str) and type(key) is not int:
            raise ProtocolError(f"{what}: a dict key must be a string or an int")
        return (kind, key)

    return {k: _list(p, f"paths[{k!r}]", item) for k, p in _dict(v, "paths").items()}


def _extra_in(v: Any, r: _Reader, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _dict(v, what).items():
        codec = _EXTRA_KEYS.get(key)
        if codec is None:
            raise ProtocolError(f"{what}: {key!r} is not a key replicas carry")
        out[key] = codec[1](value, r, f"{what}[{key!r}]")
    return out


def _shards_in(v: Any, r: _Reader, what: str) -> dict[str, tuple[ShardInfo, list[str]]]:
    def chunk(x: Any, w: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        pair = _list(x, w, lambda y, ww: y, limit=2)
        if len(pair) != 2:
            raise ProtocolError(f"{w}: not (offsets, sizes)")
        off, size = (tuple(_list(p, w, lambda y, ww: _int(y, ww), limit=64)) for p in pair)
        return off, size

    out = {}
    for k, s in _dict(v, what).items():
        d = _dict(s, f"{what}[{k!r}]")
        shape = tuple(_list(d.get("global_shape"), what, lambda y, w: _int(y, w), limit=64))
        chunks = tuple(_list(d.get("chunks"), what, chunk))
        keys = _list(d.get("keys"), what, lambda y, w: _str(y, w))
        out[k] = (ShardInfo(shape, chunks), keys)
    return out


def _skeleton_in(v: Any, r: _Reader, what: str) -> bytes | None:
    if v is None:
        return None
    if r.segment(v, what):
        raise ProtocolError(f"{what}: a skeleton to unpickle never travels")
    return b""


def _ranks_in(v: Any, r: _Reader, what: str) -> LegacyRanks:
    d = _dict(v, what)
    return LegacyRanks(
        tp_rank=_int(d.get("tp_rank"), f"{what}.tp_rank"),
        pp_rank=_int(d.get("pp_rank"), f"{what}.pp_rank"),
        pp_size=_int(d.get("pp_size"), f"{what}.pp_size"),
        write=_bool(d.get("write"), f"{what}.write"),
        distrib_optim_key=_str(d.get("distrib_optim_key"), f"{what}.distrib_optim_key"),
    )


def _components_in(v: Any, r: _Reader, what: str) -> list[tuple[str, Component, Any]]:
    def part(x: Any, w: str) -> tuple[str, Component, Any]:
        d = _dict(x, w)
        spec = _dict(d.get("component"), f"{w}.component")
        try:  # (its checks: a format known here, paths relative to the step's directory)
            c = Component(
                format=_str(spec.get("format"), f"{w}.format"),
                path=_optional(spec.get("path"), f"{w}.path", _str),
                tracker=_optional(spec.get("tracker"), f"{w}.tracker", _str),
                weights_only=_bool(spec.get("weights_only"), f"{w}.weights_only"),
            )
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"{w}: {e}") from None
        return _str(d.get("name"), f"{w}.name"), c, _extra_in(d.get("extra"), r, f"{w}.extra")

    return _list(v, what, part)


def _json_in(v: Any, r: _Reader, what: str) -> dict[str, Any]:
    return _dict(v, what)  # (plain JSON, written into the manifest as it is)


def _as_is(v: Any, segs: _Segments) -> Any:
    return v


def _ranks_out(ranks: LegacyRanks, _: _Segments) -> Any:
    return dataclasses.asdict(ranks)


def _bytes_out(data: bytes, segs: _Segments) -> Any:
    return segs.add(data)


def _bytes_in(v: Any, r: _Reader, what: str) -> bytes:
    return r.segment(v, what)


#: The format's keys a replica carries (formats/*: ``Prepared.extra``): (out, in) each.
_EXTRA_KEYS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "shards": (_shards_out, _shards_in),  # dcp, torch_dist
    "common": (_bytes_out, _bytes_in),  # torch_dist's common.pt, written as it is
    "skeleton": (_skeleton_out, _skeleton_in),  # pt, megatron_legacy: only when not written
    "ranks": (_ranks_out, _ranks_in),  # megatron_legacy
    "components": (_components_out, _components_in),
    "manifest": (_as_is, _json_in),  # components: what they add to the manifest
}


# ------------------------------------------------------------------ checked fields


def _int(v: Any, what: str) -> int:
    if type(v) is not int or v < 0:
        raise ProtocolError(f"{what}: expected a non-negative int, got {type(v).__name__}")
    return v


def _number(v: Any, what: str) -> float:
    if type(v) not in (int, float):
        raise ProtocolError(f"{what}: expected a number, got {type(v).__name__}")
    return float(v)


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"{what}: expected a string, got {type(v).__name__}")
    return v


def _bool(v: Any, what: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"{what}: expected true or false, got {type(v).__name__}")
    return v


def _choice(v: Any, what: str, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise ProtocolError(f"{what}: expected one of {choices}")
    return str(v)


def _optional(v: Any, what: str, read: Callable[[Any, str], Any]) -> Any:
    return None if v is None else read(v, what)


def _dict(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):  # (JSON: its keys are strings)
        raise ProtocolError(f"{what}: expected an object, got {type(v).__name__}")
    return v


def _list(v: Any, what: str, read: Callable[[Any, str], Any], *, limit: int | None = None) -> list:
    if not isinstance(v, list) or (limit is not None and len(v) > limit):
        raise ProtocolError(f"{what}: expected a list" + (f" of {limit} at most" if limit else ""))
    return [read(x, f"{what}[{i}]") for i, x in enumerate(v)]
