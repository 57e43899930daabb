"""The fingerprint of a run of bytes (xxh3-128), one function shared by both sides of a save:
the trainer takes it to skip copies of unchanged tensors (unchanged.py) and to check chunked
saves (bytecheck.py); the worker's differential writer (formats/differential.py) takes the
same digests to decide which files it may link instead of writing."""

from __future__ import annotations

from typing import Any

import xxhash


def fingerprint_bytes(data: Any) -> bytes:
    """xxh3-128 of a bytes-like object (released GIL: the files of a save hash in parallel)."""
    return xxhash.xxh3_128_digest(data)
