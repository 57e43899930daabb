"""The side store of the recovery at the trainers' death on node-local roots of several nodes
(``Distributed(storage="local")`` with ``MemoryTier(replicas=1)``), when node 0 is gone.

The recovery (memory_hold.persist_held, the stand-ins of replication.py) needs the ranks'
agreement and the save's group: the memory step every rank or its replica holds, DCP's plan
(rank 0 writes ``.metadata``), the node commit (rank 0's files go to every node). On a shared
root they meet over a FileStore on it (replication.recovering). Node-local roots have no path
every node sees, and rank 0's worker, which serves the side store, dies with node 0.

So a second store is served from the start by the worker of the rank that holds rank 0's
replica (``holder_of_rank0``: local rank 0 of node 1), its address published in rank 0's store
and read by every worker while that store lives. At the trainers' death a worker probes rank
0's store (``PROBE_S``): if it answers, the recovery runs over it as before; if not (node 0 is
gone), over this second store, where the holder of rank 0's replica stands in for rank 0.
The second store is torch's ``TCPStore`` (no proof asked of a client, as rank 0's), bound to
the address its worker publishes (``replication._my_address``), not every interface.
A worker cannot tell more than whether rank 0's store answers: if two survivors disagreed
(a network split), each group lacks some ranks' words and writes nothing, or writes the same
step's bytes from the same replicas; never a mix of steps.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
from typing import Any

from asyncckpt.cluster.dist import serve, side_store
from asyncckpt.cluster.framing import listen

log = logging.getLogger("asyncckpt")

#: How long a worker waits for rank 0's store to answer at its trainer's death before it takes
#: node 0 for gone (a refused connection fails at once; a live store answers in milliseconds).
PROBE_S = 5.0


def holder_of_rank0(cfg: Any) -> int:
    """The rank holding rank 0's replica (replication.peer_rank): local rank 0 of node 1."""
    return int(cfg.ranks_per_node)


def _key(token: str) -> str:
    return f"asyncckpt/{token}/recovery-store"


class BackupStore:
    """A worker's side of the second store: served here if this worker's rank holds rank 0's
    replica, and its address read from rank 0's store (in the background: the worker's start
    does not wait for it)."""

    def __init__(self, cfg: Any, my_address: str) -> None:
        self.cfg = cfg
        self.my_address = my_address  # where the other nodes reach this machine
        self.address: tuple[str, int] | None = None
        self.server: Any = None  # the TCPStore served (kept alive with this object)
        self.ready = threading.Event()
        threading.Thread(target=self._run, name="asyncckpt-backup-store", daemon=True).start()

    def _run(self) -> None:

        cfg = self.cfg
        try:
            store = side_store(cfg)
            if cfg.rank == holder_of_rank0(cfg):
                listener = listen(self.my_address)  # (the address it publishes, no other)
                port = int(listener.getsockname()[1])
                self.server = serve(dataclasses.replace(cfg, port=port), listener)
                store.set(_key(cfg.token), f"{self.my_address}:{port}")
            store.wait([_key(cfg.token)], datetime.timedelta(seconds=cfg.timeout))
            host, port_s = store.get(_key(cfg.token)).decode().rsplit(":", 1)
            self.address = (host, int(port_s))
        except Exception as e:  # noqa: BLE001 - node 0's loss then recovers nothing, said here
            log.warning(
                "rank %d: no second side store for a recovery after node 0's loss: %s",
                cfg.rank,
                e,
            )
        finally:
            self.ready.set()

    def recovering(self, config: Any) -> Any:
        """A worker's config for the recovery at its trainer's death: unchanged while rank 0's
        store answers, else agreeing over the second store (stand-ins inherit it)."""
        if rank0_store_answers(config.dist):
            return config
        self.ready.wait(PROBE_S)
        if self.address is None:
            log.warning(
                "rank %d: rank 0's side store is gone and no second store is known: the "
                "memory tier is not recovered",
                config.dist.rank,
            )
            return config
        host, port = self.address
        log.warning(
            "rank %d: rank 0's side store is gone (node 0 lost): the recovery agrees over the "
            "second store at %s:%d",
            config.dist.rank,
            host,
            port,
        )
        dist = dataclasses.replace(config.dist, host=host, port=port)
        return dataclasses.replace(config, dist=dist)


def rank0_store_answers(cfg: Any) -> bool:
    """Whether rank 0's worker's store answers within ``PROBE_S``."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(cfg.host, cfg.port, None, False, datetime.timedelta(seconds=PROBE_S))
        store.num_keys()
        return True
    except Exception:  # noqa: BLE001 - refused, reset or timed out: gone for this purpose
        return False
