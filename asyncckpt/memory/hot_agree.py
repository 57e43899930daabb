"""Several ranks take a step offered before it was written all from memory, or none of them.

Each rank's surviving worker offers its own part of the step it persists after the trainers'
death before writing it (hot_serve.offer_staged). Each new rank copies its part from that
memory, checked against the checksums its worker offered (hot_load), then says over the old
run's side store (``Offer.vote``: served by the old rank 0's worker, alive until the new rank
0 has read its offer) whether it did and what it holds. The step is kept only when every rank
took the same step and the tensors and objects several ranks hold under one key are the same
bytes on each (DCP writes such a key once, from one rank: the disk's copy is then every
rank's, and so is the memory's). Otherwise every rank reads the step from disk once its
worker is done; a rank that copied its memory already then restores the whole target from
there (hot_resume.py ``spoiled``).

A rank that never says (no offer reached it, a crash) makes the others wait the side store's
timeout, then read the disk; a rank whose worker died with its trainer is told to the old run
by its new engine before that (peer_gone.py), so its peers' workers never offer the step.

A word is JSON (``encode_word``), never a pickle: the side store takes writes from anyone who
reaches it. A word that is not what this module writes (``decode_word``) is refused: the rank
that read it keeps nothing from memory and reads the disk, as after any failed agreement.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from asyncckpt.cluster import dist as _dist
from asyncckpt.cluster.peerdata import Reader, SignedStore, dumps, loads
from asyncckpt.memory.hot_serve import Offer
from asyncckpt.storage.manifest import checksum

#: What one rank says: (step, {tensor key: CRC-32C}, {object key: CRC-32C}), or None (no).
Word = tuple[int, dict[str, int], dict[str, int]] | None


def word_of(offer: Offer) -> Word:
    """What a rank that took ``offer`` says: its step and the checksum of every key it holds."""
    tensors = {fqn: crc for fqn, (_, _, crc) in (offer.staged or {}).items()}
    objects = {key: checksum(data) for key, data in (offer.objects or {}).items()}
    return offer.step, tensors, objects


def agree(offer: Offer, rank: int, world_size: int, took: bool) -> tuple[bool, str]:
    """Say over ``offer.vote`` whether this rank took ``offer`` (``took``); True when every
    rank took the same step with the same bytes under every shared key, else False and why."""
    cfg = offer.vote
    prefix = f"asyncckpt/{cfg.token}/hot-early/"
    mine: Word = word_of(offer) if took else None
    try:
        store = SignedStore(_dist.side_store(cfg), cfg.secret)  # a stranger's word: refused
        store.set(prefix + str(rank), encode_word(mine))
        if mine is None:  # (a "no" needs no other word)
            store.add(prefix + "heard", 1)
            return False, "this rank did not take it"
        keys = [prefix + str(r) for r in range(world_size)]
        store.wait(keys, datetime.timedelta(seconds=cfg.timeout))
        said = [store.raw(k) for k in keys]  # checked below: a refusal keeps the timing
        store.add(prefix + "heard", 1)
        if rank == 0:  # its old worker serves the store: the others read first
            wait_count(store, prefix + "heard", world_size, cfg.timeout)
        words = [
            decode_word(store.open(k, raw), f"the side store's {k!r}")
            for k, raw in zip(keys, said, strict=True)
        ]
    except Exception as e:  # noqa: BLE001 - no agreement: the disk, on every rank
        return False, f"the ranks could not agree over the side store: {e}"
    why = judge(words)
    return why is None, why or ""


def encode_word(word: Word) -> bytes:
    """``word`` as the side store keeps it (JSON)."""
    if word is None:
        return dumps(None)
    step, tensors, objects = word
    return dumps({"step": step, "tensors": tensors, "objects": objects})


def decode_word(raw: bytes, what: str) -> Word:
    """The word ``encode_word`` wrote, or ``peerdata.Malformed`` (``what``: where it came
    from)."""
    value = loads(raw, what)
    if value is None:
        return None
    r = Reader(what)
    v = r.record(value, "", ("step", "tensors", "objects"))
    return (
        r.integer(v["step"], "step"),
        r.by_name(v["tensors"], "tensors", r.crc),
        r.by_name(v["objects"], "objects", r.crc),
    )


def judge(words: list[Word]) -> str | None:
    """Why the ranks' words do not let every rank keep its memory, or None."""
    if any(w is None for w in words):
        return "another rank's memory did not match or was not taken"
    steps = {w[0] for w in words if w is not None}
    if len(steps) > 1:
        return f"the ranks hold different steps ({sorted(steps)})"
    held = [w for w in words if w is not None]
    for kind, maps in (("tensor", [w[1] for w in held]), ("object", [w[2] for w in held])):
        seen: dict[str, tuple[int, int]] = {}  # key -> (rank, checksum)
        for r, crcs in enumerate(maps):
            for key, crc in crcs.items():
                first = seen.setdefault(key, (r, crc))
                if first[1] != crc:
                    return (
                        f"ranks {first[0]} and {r} hold different bytes for the {kind} {key!r} "
                        "(the disk keeps one rank's copy)"
                    )
    return None


def wait_count(store: Any, key: str, n: int, timeout: float) -> bool:
    """Until the counter ``key`` reaches ``n`` (every rank has read what it needed), at most
    ``timeout`` seconds; whether it did."""
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < n:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True
