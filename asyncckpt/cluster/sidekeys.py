"""The side store's per-save keys: removed once no rank can still read them.

Every save meets under its own prefix (step and attempt: ``peer_gone.meet``'s counter), and a
save that forms a fresh gloo group of the workers over the side store (``dist.job_group``)
leaves one key per rank there (its address, read by a peer when the pair first connects).
Nothing else removes them, so a long run grew rank 0's worker (which serves the store) by N
keys per save, without bound.

When a key may go: a worker runs its jobs one after the other, so a rank that took part in the
gather of job J (the commit's agreement: rank 0 receives every rank's result) has left every
job group it joined before J. Rank 0's worker, once J's group closes without an error (its
gather returned), removes the keys of the groups it had joined before J. J's own keys stay
until a later job's gather proves every rank left J. A group that failed (a peer died or timed
out) keeps its keys until a later job succeeds; the keys of a group rank 0 never joined are
not known to it and stay (a failure case: their ranks waited for rank 0 until the timeout).

The removal runs on a thread of its own: one ``delete_key`` per rank per save (N requests to
the store rank 0's worker serves itself), off the path of the commit and of the next job.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from asyncckpt.cluster import dist as _dist

log = logging.getLogger("asyncckpt")


def job_prefix(token: str) -> str:
    """Under which prefix the job groups of run ``token`` keep their keys (dist.job_group)."""
    return f"asyncckpt/{token}/"


def forget(store: Any, token: str, tags: Iterable[str]) -> int:
    """Delete the keys the job groups ``tags`` of run ``token`` left in ``store``; how many.

    Raises what the store raises (``list_keys`` / ``delete_key`` unsupported, unreachable)."""
    import torch.distributed as dist

    wanted = {f"{t}/" for t in tags}
    if not wanted:
        return 0
    scoped = dist.PrefixStore(job_prefix(token).rstrip("/"), store)
    deleted = 0
    for key in scoped.list_keys():  # (the PrefixStore lists its own keys, prefix stripped)
        if any(key.startswith(w) for w in wanted) and scoped.delete_key(key):
            deleted += 1
    return deleted


class JobKeys:
    """Forms the job groups of one worker (``group``) and, on rank 0, removes the keys of the
    groups every rank has left. ``deleted`` counts the keys removed; ``unsupported`` says why
    none can be (a store without ``list_keys`` / ``delete_key``: logged once)."""

    def __init__(self) -> None:
        self.joined: list[str] = []  # rank 0: groups joined, not yet known to be left by all
        self.deleted = 0
        self.unsupported: str | None = None
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def group(self, cfg: _dist.DistConfig, tag: str, reuse: bool = False) -> Iterator[Any]:
        """``dist.job_group(cfg, tag, reuse=reuse, keep=True)``; on rank 0 a clean exit (the
        job's gather returned: every rank is in this job, past all earlier ones) frees the
        earlier jobs' keys."""
        try:
            with _dist.job_group(cfg, tag, reuse=reuse, keep=True) as pg:
                yield pg
            if cfg.rank == 0:
                left = [t for t in self.joined if t != tag]
                self.joined = [t for t in self.joined if t == tag]
                if left:
                    self._submit(cfg, left)
        finally:
            if cfg.rank == 0 and tag not in self.joined:
                self.joined.append(tag)

    def _submit(self, cfg: _dist.DistConfig, tags: list[str]) -> None:
        if self.unsupported is not None:
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, args=(cfg,), name="asyncckpt-side-keys", daemon=True
            )
            self._thread.start()
        self._todo.put(tags)

    def _run(self, cfg: _dist.DistConfig) -> None:
        store: Any = None
        pending: list[str] = []  # tags whose keys a failed attempt left: tried again
        while True:
            tags = self._todo.get()
            if tags is None:
                return
            pending += tags
            try:
                if store is None:
                    store = _dist.side_store(cfg)
                self.deleted += forget(store, cfg.token, pending)
                pending = []
            except Exception as e:  # noqa: BLE001 - never fails a save: the keys only wait
                if isinstance(e, (AttributeError, NotImplementedError)) or any(
                    w in str(e).lower() for w in ("not implemented", "not supported")
                ):
                    self.unsupported = f"{type(e).__name__}: {e}"
                    log.warning(
                        "the side store cannot list or delete keys (%s): every save leaves "
                        "one key per rank in it for as long as the run lasts",
                        self.unsupported,
                    )
                    return
                log.debug("side store keys of %s kept for now: %s", pending, e)
                store = None  # (unreachable for now: tried again with the next job's)

    def close(self) -> None:
        """Stop the deleting thread once it has done what was asked (tests)."""
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None
