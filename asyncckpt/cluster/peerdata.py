"""Values that come from another process (the side store, a local socket): JSON, decoded by
type, never unpickled.

The workers' side store is torch's TCPStore, which anyone who reaches its port may write to;
a pickle read from it would run whatever its writer put in. So what asyncckpt keeps there
(and what a surviving worker offers over its socket) is JSON, and each reader decodes it with
the checks below: the exact keys, the exact types (``True`` is not an int here), the ranges.
Anything else raises ``Malformed``, naming the value and the place in it, and the reader
treats it as a failure of the exchange it belongs to (the caller says which fallback).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
from collections.abc import Callable, Collection
from typing import Any, NoReturn, TypeVar

import torch

from asyncckpt.errors import CheckpointError

T = TypeVar("T")

#: The most bytes of one value a reader decodes (a larger one is refused unread).
MAX_VALUE_BYTES = 64 << 20
#: A CRC-32C: 32 bits.
CRC_MAX = (1 << 32) - 1


#: The dtypes a tensor sent by a peer may have, by name (a replica, a hot-resume offer).
DTYPES: dict[str, torch.dtype] = {
    name: d
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex128",
        "complex64",
        "complex32",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )  # fmt: skip
    if isinstance(d := getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES = {d: name for name, d in DTYPES.items()}


class Malformed(CheckpointError, ValueError):
    """A value read from the side store or a socket is not one asyncckpt writes: refused."""


def dumps(value: Any) -> bytes:
    """``value`` (dicts, lists, str, int, float, bool, None) as compact JSON bytes."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number asyncckpt writes")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} twice")
        out[k] = v
    return out


def loads(raw: bytes, what: str, limit: int = MAX_VALUE_BYTES) -> Any:
    """The JSON value in ``raw`` (``what``: where it came from, for the error), or
    ``Malformed``: too long, not UTF-8, not JSON, a key twice, NaN or Infinity."""
    if not isinstance(raw, (bytes, bytearray)):
        raise Malformed(f"refused {what}: not bytes but {type(raw).__name__}")
    if len(raw) > limit:
        raise Malformed(f"refused {what}: {len(raw)} bytes, over the {limit} this reader takes")
    try:
        return json.loads(
            bytes(raw).decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_unique
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Malformed(
            f"refused {what}: not JSON as asyncckpt writes it ({e}); another program (or "
            "another asyncckpt version) wrote there"
        ) from None


class Reader:
    """Typed access to one decoded value; every refusal names ``what`` and the place in it."""

    def __init__(self, what: str) -> None:
        self.what = what

    def fail(self, at: str, why: str) -> NoReturn:
        raise Malformed(f"refused {self.what}: {at or 'the value'}: {why}")

    def record(self, v: Any, at: str, keys: Collection[str]) -> dict[str, Any]:
        """A JSON object holding exactly ``keys``."""
        if not isinstance(v, dict):
            self.fail(at, f"expected an object, got {_kind(v)}")
        missing, extra = sorted(set(keys) - v.keys()), sorted(v.keys() - set(keys))
        if missing or extra:
            self.fail(at, f"expected the keys {sorted(keys)}; missing {missing}, unknown {extra}")
        return v

    def integer(self, v: Any, at: str, lo: int = 0, hi: int | None = None) -> int:
        if type(v) is not int:
            self.fail(at, f"expected an integer, got {_kind(v)}")
        if v < lo or (hi is not None and v > hi):
            self.fail(at, f"{v} is out of range [{lo}, {hi if hi is not None else 'inf'}]")
        return v

    def number(self, v: Any, at: str) -> float:
        if type(v) not in (int, float) or not math.isfinite(v):
            self.fail(at, f"expected a finite number, got {_kind(v)}")
        return float(v)

    def text(self, v: Any, at: str) -> str:
        if not isinstance(v, str):
            self.fail(at, f"expected a string, got {_kind(v)}")
        return v

    def flag(self, v: Any, at: str) -> bool:
        if not isinstance(v, bool):
            self.fail(at, f"expected true or false, got {_kind(v)}")
        return v

    def crc(self, v: Any, at: str) -> int:
        return self.integer(v, at, 0, CRC_MAX)

    def blob(self, v: Any, at: str) -> bytes:
        """Bytes written as base64."""
        try:
            return base64.b64decode(self.text(v, at), validate=True)
        except binascii.Error as e:
            self.fail(at, f"not base64 ({e})")

    def items(self, v: Any, at: str, item: Callable[[Any, str], T]) -> list[T]:
        if not isinstance(v, list):
            self.fail(at, f"expected a list, got {_kind(v)}")
        return [item(x, f"{at}[{i}]") for i, x in enumerate(v)]

    def by_name(self, v: Any, at: str, value: Callable[[Any, str], T]) -> dict[str, T]:
        """A JSON object whose values ``value`` decodes (its keys are names)."""
        if not isinstance(v, dict):
            self.fail(at, f"expected an object, got {_kind(v)}")
        return {k: value(x, f"{at}[{k!r}]") for k, x in v.items()}

    def by_number(
        self, v: Any, at: str, value: Callable[[Any, str], T], hi: int | None = None
    ) -> dict[int, T]:
        """A JSON object keyed by non-negative integers written in decimal (JSON's keys are
        strings), at most ``hi``."""
        out: dict[int, T] = {}
        for k, x in self.by_name(v, at, lambda x, _: x).items():
            if not (k.isascii() and k.isdigit()) or str(int(k)) != k:
                self.fail(f"{at}[{k!r}]", "a key that is not a non-negative integer")
            n = int(k)
            if hi is not None and n > hi:
                self.fail(f"{at}[{k!r}]", f"{n} is out of range [0, {hi}]")
            out[n] = value(x, f"{at}[{k!r}]")
        return out


def encode_blob(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "an integer"}.get(
        type(v), type(v).__name__
    )


class SignedStore:
    """A side store whose values carry an HMAC of the run's secret over their key and bytes:
    ``get`` refuses (``Malformed``) a value written by anyone who does not know the secret, or
    moved from another key. The TCPStore takes writes from anyone who reaches its port; a
    forged but well-formed value (a load's plan naming replicas to drop, say) would otherwise be
    acted on. What is not a value (``add`` counters, ``wait``, ``check``, ``delete_key``)
    passes through: a stranger can delay or fail an exchange there, not steer it."""

    #: What a signed value starts with: the scheme, then the MAC, then the payload.
    TAG = b"ACKS1"

    def __init__(self, store: Any, secret: str) -> None:
        if not secret:
            raise ValueError(
                "signing side-store values needs the run's secret (DistConfig.secret), which "
                "rank 0 publishes at start"
            )
        self._store = store
        self._key = secret.encode()

    def _mac(self, key: str, payload: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + payload, hashlib.sha256).digest()

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, self.TAG + self._mac(key, value) + value)

    def get(self, key: str) -> bytes:
        return self.open(key, self.raw(key))

    def raw(self, key: str) -> bytes:
        """The value under ``key`` as it is in the store, not checked yet (``open``)."""
        return bytes(self._store.get(key))

    def open(self, key: str, raw: bytes) -> bytes:
        """The payload of ``raw``, read from under ``key``, or ``Malformed`` if this run did not
        write it there."""
        start = len(self.TAG) + hashlib.sha256().digest_size
        if not raw.startswith(self.TAG) or not hmac.compare_digest(
            raw[len(self.TAG) : start], self._mac(key, raw[start:])
        ):
            raise Malformed(
                f"refused the side store's {key!r}: not written by this run (its value does not "
                "carry the run's signature); another process on the job's network wrote there"
            )
        return raw[start:]

    def __getattr__(self, name: str) -> Any:  # add, wait, check, delete_key: as they are
        return getattr(self._store, name)
