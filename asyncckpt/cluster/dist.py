"""Rank coordination on a side group: the workers of all ranks agree on every commit.

Training ranks never run a collective for asyncckpt after ``start``. What happens instead:

- **At start (once).** The engine learns its rank and world size (explicit ``rank=`` /
  ``world_size=``, else ``torch.distributed`` if it is initialised). Rank 0's trainer binds a
  listening socket for the workers' side store and publishes ``host:port:run-token`` under one
  key of the training group's *store* -- a key ``set``/``get``, not a collective, so no
  training collective is ever issued or reordered. Without an initialised process group,
  ``store=(host, port)`` (or ``MASTER_ADDR`` and ``MASTER_PORT + 1``) says where rank 0's
  trainer hosts a ``TCPStore`` for that publication only. The same value carries the run's
  secret (``DistConfig.secret``, made with ``secrets`` by rank 0's trainer): every connection
  between the workers (replicas, the node-local fetch; framing.py) proves it with a
  challenge-response before anything else is read. It lives in the processes' memory (the
  workers get it with their config over their pipes) and in that one key of the training
  group's store, never in the side store, a log line or a file: a process that can read the
  training group's store can read it, as it can join that group (torch.distributed trusts
  the job's network; docs say so). Rank 0 cleans the leftovers of an
  interrupted run *before* it publishes, so that publication is also the only start-up barrier
  the other ranks wait on.
- **Who serves the side store.** Rank 0's *worker*, on the socket its trainer bound and hands
  to every worker it spawns (``serve``). A save whose ``save()`` returned must commit even if
  rank 0's trainer is then killed, so the store must not live in the trainer; the worker
  finishes its staged jobs after its trainer dies (worker/loop.py), and rank 0's worker is the one
  that commits, so nothing is gained by the store outliving it. The socket (not a port number)
  is what the trainer keeps: a restarted rank-0 worker serves a fresh store on the same
  address, so no rank has to learn a new one and no other process can take the port meanwhile
  (a client that connects during the restart waits in the socket's backlog for the new worker).
- **Per save.** Every rank's worker uses a gloo group for the job over that store, through
  one connection per worker kept across saves (``job_store``). The group is kept from one
  save to the next while every rank holds it; it is formed afresh (a ``PrefixStore`` per
  step and attempt) when any rank lacks it, so a restarted worker or a failed save never
  leaves a broken group behind (``job_group``; rank 0's worker deletes the keys once every
  rank has left them, sidekeys.py; connected eagerly: ``job_group`` says why not lazily).
  DCP plans and writes each rank's own shards over that group; the workers
  then gather a success flag with their file checksums on rank 0 (gloo detects a dead peer, and
  the group's timeout a hung one); only if every rank succeeded does rank 0's worker write the
  manifest, rename the directory into place and write the tracker, then broadcast the outcome.
  Any failure anywhere fails every rank's handle with the cause and commits nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncckpt import errors
from asyncckpt.cluster.framing import listen

log = logging.getLogger("asyncckpt")

#: Default time a worker waits for the other ranks' workers (rendezvous, agreement, commit).
DEFAULT_TIMEOUT = 600.0
#: The environment variable naming the host the other ranks reach rank 0's store on.
HOST_ENV = "ASYNCCKPT_STORE_HOST"


_engine_starts = 0  # per process; every rank starts its engines in the same order


@dataclass(frozen=True)
class DistConfig:
    """What a worker needs to join the side group of its job (picklable)."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    port: int
    token: str
    timeout: float = DEFAULT_TIMEOUT
    #: A FileStore on the shared root, in place of rank 0's store, once the trainers died
    #: with ``MemoryTier(replicas=1)`` (``replication.recovering``): node 0's loss takes rank
    #: 0's worker and the store it serves, not the shared root.
    recovery_store: str | None = None
    #: Node-local roots on several nodes (``Distributed(storage="local")``): how many ranks
    #: each node runs; every node's local rank 0 commits its node's directory
    #: (node_commit.py). 0: one root every rank writes, rank 0 commits.
    ranks_per_node: int = 0
    #: The run's secret (hex): every connection between the workers proves it (framing.py).
    #: Made by rank 0's trainer, read by the others from the training group's store; never
    #: shown (``repr``), logged, put in the side store or written to disk.
    secret: str = field(default="", repr=False)


def detect(
    rank: int | None, world_size: int | None, local_rank: int | None = None
) -> tuple[int, int, int]:
    """(rank, world size, local rank): explicit values win, else torch.distributed, else 0/1."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        # An explicit world_size=1 under torch.distributed: a rank checkpointing on its own.
        rank = 0 if world_size == 1 else (dist.get_rank() if initialised else None)
        if rank is None:
            raise ValueError("world_size > 1 needs rank= (or an initialised torch.distributed)")
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return rank, world_size, local_rank


@dataclass(frozen=True)
class Node:
    """Which node a rank runs on (``node_rank``) and how many ranks every node runs."""

    node_rank: int
    ranks_per_node: int


def detect_node(
    rank: int,
    world_size: int,
    local_rank: int,
    node_rank: int | None = None,
    ranks_per_node: int | None = None,
) -> Node | None:
    """This rank's node: explicit values win, else torchrun's ``$GROUP_RANK`` /
    ``$LOCAL_WORLD_SIZE``; else one node with every rank when the local rank is the rank, and
    None (unknown) when it is not. Ranks must be laid out as torchrun lays them out (node ``n``
    runs ranks ``n * ranks_per_node ...``, local rank = position): what a peer node is, and
    which node holds a replica, is computed from that."""
    if ranks_per_node is None and world_size > 1:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        ranks_per_node = int(env) if env else None
    if node_rank is None and world_size > 1:
        env = os.environ.get("GROUP_RANK")
        node_rank = int(env) if env else None
    if ranks_per_node is None and node_rank is None:
        if local_rank != rank:
            return None  # several nodes, of a size nobody said
        return Node(0, world_size)
    if ranks_per_node is None or node_rank is None:
        raise ValueError(
            "node_rank and ranks_per_node go together (Distributed(node_rank=..., "
            f"ranks_per_node=...)); got node_rank={node_rank}, ranks_per_node={ranks_per_node}"
        )
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not divide world_size={world_size}: every "
            "node must run the same number of ranks"
        )
    nodes = world_size // ranks_per_node
    if not 0 <= node_rank < nodes:
        raise ValueError(f"node_rank {node_rank} is out of range for {nodes} node(s)")
    if rank != node_rank * ranks_per_node + local_rank:
        raise ValueError(
            f"rank {rank} is not local rank {local_rank} of node {node_rank} with "
            f"{ranks_per_node} ranks per node (expected rank "
            f"{node_rank * ranks_per_node + local_rank}): pass Distributed(node_rank=..., "
            "ranks_per_node=..., local_rank=...) that match torchrun's layout"
        )
    return Node(node_rank, ranks_per_node)


def _store_host() -> str:
    return os.environ.get(HOST_ENV) or os.environ.get("MASTER_ADDR") or "127.0.0.1"


class Rendezvous:
    """The engine side: rank 0 binds the side store's socket; every rank learns where it is.

    Rank 0 binds the address it publishes (``ASYNCCKPT_STORE_HOST``, else ``MASTER_ADDR``,
    else ``127.0.0.1``; with ``store=(host, port)``, that host), not every interface: the
    other ranks' workers connect there and nothing else needs to. The store itself is torch's
    ``TCPStore``: it takes no proof from a client (torch's stores trust the job's network), so
    nothing read from it is unpickled (the workers' own connections prove the run's secret).

    ``close`` closes the socket (clients are refused from then on, once no worker holds it).
    """

    def __init__(self) -> None:
        self.server: Any = None  # rank 0 with store=(host, port): where the address is published
        self.listener: socket.socket | None = None  # rank 0: handed to each worker it spawns

    def setup(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        *,
        store: tuple[str, int] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        before_publish: Any = None,
    ) -> DistConfig:
        """Agree on (host, port, token). ``before_publish`` runs on rank 0 before the others
        are let go (the leftover cleanup)."""
        import torch.distributed as dist

        global _engine_starts
        _engine_starts += 1
        key = f"asyncckpt/engine/{_engine_starts}"
        td = datetime.timedelta(seconds=timeout)
        initialised = dist.is_available() and dist.is_initialized()
        if store is None and not initialised:
            addr, master_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not addr or not master_port:
                raise ValueError(
                    "a multi-rank engine needs torch.distributed initialised, store=(host, port), "
                    "or MASTER_ADDR and MASTER_PORT in the environment"
                )
            store = (addr, int(master_port) + 1)
        if rank == 0:
            # The side store listens on the address published for it, not every interface.
            host = _store_host() if store is None else store[0]
            self.listener = listen(host)
            port = self.listener.getsockname()[1]
            if store is None:
                publish = dist.distributed_c10d._get_default_store()
            else:
                self.server = dist.TCPStore(
                    host, store[1], None, True, td, wait_for_workers=False, use_libuv=True
                )
                publish = self.server
            token = uuid.uuid4().hex[:12]
            secret = secrets.token_hex(32)
            try:
                if before_publish is not None:
                    before_publish()
            except BaseException as e:
                # Let the other ranks fail with the cause instead of waiting for a timeout.
                publish.set(key, f"error:{type(e).__name__}: {e}")
                raise
            publish.set(key, f"{host}:{port}:{token}:{secret}")
        else:
            if store is None:
                raw = dist.distributed_c10d._get_default_store().get(key).decode()
            else:
                client = dist.TCPStore(store[0], store[1], None, False, td)
                raw = client.get(key).decode()
                del client
            if raw.startswith("error:"):
                raise relayed_failure("rank 0 could not start its checkpoint engine", raw[6:])
            host, port_s, token, secret = raw.rsplit(":", 3)
            port = int(port_s)
            if store is not None:
                host = store[0]
        log.debug("rank %d: side store at %s:%d, run token %s", rank, host, port, token)
        return DistConfig(
            rank, world_size, local_rank, host, int(port), token, timeout, secret=secret
        )

    def close(self) -> None:
        self.server = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None


# ------------------------------------------------------------------------------ worker side


def serve(cfg: DistConfig, listener: socket.socket) -> Any:
    """Rank 0's worker: the side store, served on the socket its trainer bound (keep the
    returned object alive for as long as the worker runs)."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=cfg.timeout)
    store = dist.TCPStore(
        cfg.host,
        cfg.port,
        None,
        True,
        td,
        wait_for_workers=False,
        use_libuv=True,
        master_listen_fd=listener.detach(),  # the store owns (and closes) this copy
    )
    # Which store a client reached: a restarted worker serves a new one on the same address,
    # and a client that lost its connection must know whether what it wrote went with it.
    store.set(STORE_ID_KEY, uuid.uuid4().hex)
    return store


#: The key under which rank 0's worker names the store it serves (``serve``).
STORE_ID_KEY = "asyncckpt/store-id"


def side_store(cfg: DistConfig, timeout: float | None = None) -> Any:
    """A client of the workers' side store: rank 0's worker's ``TCPStore``, or the shared
    root's FileStore during a recovery (``DistConfig.recovery_store``)."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout if timeout is not None else cfg.timeout)
    if cfg.recovery_store is not None:
        # -1: never removed by a client's exit (more clients than ranks come and go); rank
        # 0's speaker removes it once the recovery is over (memory_hold.persist_held).
        store = dist.FileStore(cfg.recovery_store, -1)
        store.set_timeout(td)
        return store
    return dist.TCPStore(cfg.host, cfg.port, None, False, td)


#: This process's connection to the side store, kept across jobs (``job_store``).
_job_client: dict[tuple[str, int], Any] = {}


def relayed_failure(what: str, cause: str) -> Exception:
    """Another rank's failure to start, as it published it (``"<class name>: <message>"``), to
    raise here: the same asyncckpt error class where it is one (a trainer catching, say,
    ``UncommittedResume`` does so on every rank), else ``RuntimeError``."""
    text = f"{what}: {cause}"
    cls = getattr(errors, cause.partition(":")[0], None)
    if isinstance(cls, type) and issubclass(cls, errors.CheckpointError):
        try:
            return cls(text)
        except TypeError:  # a class that needs more than a message
            pass
    return RuntimeError(text)


def job_store(cfg: DistConfig, *, named: bool = False) -> Any:
    """The side store for a job group: one client connection per worker, reused by every
    job. A connection per save made every rank reconnect to the one store each save (N
    connections per save at the store, a storm at 10,000 ranks); on this machine's network
    stack 1 in ~10 of 32 simultaneous reconnections took 5 s, which every rank of the save
    then waited for. A reused connection that no longer answers (rank 0's worker restarted
    and serves a fresh store) is replaced before the job uses it.

    ``named``: the store is known to be one ``serve`` names (so is any store after one that
    said its name), so a new connection waits (up to the run's timeout) for its name: a
    restarted worker's store accepts the clients queued in its socket's backlog before it has
    set it, and a connection that recorded no name could not tell that store from the next."""
    if cfg.recovery_store is not None:
        return side_store(cfg)
    key = (cfg.host, cfg.port)
    store = _job_client.get(key)
    if store is not None:
        try:
            store.num_keys()  # (one round trip: a dead server fails it at once)
            return store
        except Exception as e:  # noqa: BLE001 - reconnect; if that fails, the job fails
            log.info("the side store's connection is gone (%s): reconnecting", e)
            _job_client.pop(key, None)
    named = named or _job_store_id.get(key) is not None
    store = side_store(cfg)
    _job_client[key] = store
    # (a store served by ``serve`` names itself at once; a bare one, in tests, does not)
    if named:
        store.wait([STORE_ID_KEY])  # (the client's timeout: the run's)
    _job_store_id[key] = store.get(STORE_ID_KEY).decode() if store.check([STORE_ID_KEY]) else None
    return store


def job_store_id(cfg: DistConfig) -> str | None:
    """Which store this worker's connection (``job_store``) reached, if it said."""
    return _job_store_id.get((cfg.host, cfg.port))


#: The store each connection of ``_job_client`` reached (``serve``'s ``STORE_ID_KEY``).
_job_store_id: dict[tuple[str, int], str | None] = {}


#: The job group this worker keeps between saves, and what it was formed over (``job_group``).
_kept: dict[str, Any] = {}


def _formed_over(cfg: DistConfig) -> tuple:
    """Everything a kept group depends on: another store, run, rank, size or timeout is
    another group."""
    return (cfg.host, cfg.port, cfg.token, cfg.recovery_store, cfg.rank, cfg.world_size,
            cfg.timeout, cfg.ranks_per_node)  # fmt: skip


#: Seconds a kept job group may sit idle and still serve: an idle connection can be dropped
#: silently on the way (a firewall's or load balancer's idle timeout, 350 s on some clouds),
#: and a save on a broken group waits out its timeout. Saves further apart form their own.
KEEP_IDLE_S = 300.0


def holds_group(cfg: DistConfig) -> bool:
    """Whether this worker keeps a sound job group over ``cfg`` from a recent save."""
    import torch.distributed as dist

    return (
        dist.is_initialized()
        and _kept.get("over") == _formed_over(cfg)
        and time.monotonic() - _kept["at"] < KEEP_IDLE_S
    )


def drop_group() -> None:
    """Tear down the kept job group (a failed save, another run): the next job forms one."""
    import torch.distributed as dist

    _kept.clear()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def forget_job_store(cfg: DistConfig) -> None:
    """Drop this worker's connection to the side store: the next ``job_store`` opens one."""
    _job_client.pop((cfg.host, cfg.port), None)


@contextlib.contextmanager
def job_group(
    cfg: DistConfig, tag: str, *, reuse: bool = False, keep: bool = False
) -> Iterator[Any]:
    """A gloo group of every rank's worker for one job.

    It is the worker's default group (DCP's collectives need a registered group). Forming one
    connects every pair of ranks: N(N-1)/2 connections and N(N-1) store reads in all, which
    every save paid until this release. Now a save's group is kept (``keep=True``) and the
    next save reuses it (``reuse=True``) when every rank said it still holds it
    (``peer_gone.meet``); any rank without one (a restarted worker, a failed save, another
    job's group in between) makes every rank form a fresh group under ``tag``. A group that
    saw an error is torn down (``drop_group``), so a dead or restarted worker leaves nothing
    broken for the next save.

    Connected eagerly (every pair at creation), not with gloo's lazy connection: lazily, a
    survivor's save hung for minutes past the group's timeout when a peer had died (a pair
    already connected to a rank that had given up waited on it), reproduced in 2 of 3 runs
    under load, none eagerly. A rank that never comes fails the creation at the timeout.
    """
    import torch.distributed as dist

    try:
        if reuse:
            if not holds_group(cfg):  # (meet said every rank holds one: this one must)
                raise RuntimeError(f"job {tag}: asked to reuse a job group this worker lacks")
        else:
            drop_group()
            td = datetime.timedelta(seconds=cfg.timeout)
            store = dist.PrefixStore(f"asyncckpt/{cfg.token}/{tag}", job_store(cfg))
            dist.init_process_group(
                "gloo", store=store, rank=cfg.rank, world_size=cfg.world_size, timeout=td
            )
        yield dist.group.WORLD
    except BaseException:
        # A broken group (a peer died or timed out) may leave a store request unanswered on
        # the connection: the next job starts on a fresh one, and a fresh group.
        drop_group()
        forget_job_store(cfg)
        raise
    if keep:
        _kept.update(over=_formed_over(cfg), at=time.monotonic())
    else:
        drop_group()


def all_gather(pg: Any, obj: Any, world_size: int) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=pg)
    return out


def gather(pg: Any, obj: Any, world_size: int, rank: int) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None on the others): what only rank 0 needs. An
    all-gather would hand all N ranks' objects to each of the N ranks (N^2 over the group).

    Star-shaped: each rank's size goes to rank 0 in one gather of a fixed-size tensor, then
    its pickled bytes in one message to rank 0. ``dist.gather_object`` all-gathers the sizes
    (N^2 messages in all) and pads every rank's object to the largest."""
    import pickle

    import torch.distributed as dist

    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)] if rank == 0 else None
    dist.gather(size, sizes, dst=0, group=pg)
    if rank != 0:
        dist.send(data, dst=0, group=pg)
        return None
    assert sizes is not None
    out: list[Any] = [obj]
    for r in range(1, world_size):
        buf = torch.empty(int(sizes[r].item()), dtype=torch.uint8)
        dist.recv(buf, src=r, group=pg)
        out.append(pickle.loads(buf.numpy().tobytes()))
    return out


def broadcast(pg: Any, obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=pg)
    return box[0]


def ranks_error(failed: list[tuple[int, dict]]) -> dict[str, Any]:
    """One error for every rank's handle: each failed rank's error, the root cause first.

    DCP wraps a peer's failure in a ``CheckpointException`` on the ranks that did not fail
    themselves; an error with an errno (the injected EIO, a full disk) is the likelier cause.
    """
    failed = sorted(failed, key=lambda rf: (rf[1].get("errno") is None, rf[0]))
    first = failed[0][1]
    message = "; ".join(f"rank {r}: {i['type']}: {i['message']}" for r, i in failed)
    return {
        "type": first["type"],
        "message": f"not committed on any rank: {message}",
        "errno": first.get("errno"),
        "traceback": f"rank {failed[0][0]}:\n" + first.get("traceback", ""),
    }
