"""Where an engine sits in the job (``Ranks``) and what follows from it: its memory replicas'
peers, whether its root is node-local, and what node-local roots refuse."""

from __future__ import annotations

from dataclasses import dataclass

from asyncckpt.cluster.dist import Node
from asyncckpt.memory.replication import ReplicaConfig, peer_rank, source_rank
from asyncckpt.options import EngineOptions
from asyncckpt.storage import RemoteTier


@dataclass(frozen=True)
class Ranks:
    """Where this engine sits in the job: the one source of its rank and node (``dist.detect``,
    ``dist.detect_node``)."""

    rank: int
    world_size: int
    local_rank: int
    node: Node | None = None  # None: several nodes of a size nobody said

    @property
    def nodes(self) -> int | None:
        return None if self.node is None else self.world_size // self.node.ranks_per_node


def replication(ranks: Ranks, opts: EngineOptions) -> ReplicaConfig | None:
    """``MemoryTier(replicas=1)``: whom this rank's worker sends its memory saves to and whose
    it holds (replication.py); refused where there is no other node to hold them."""
    if not opts.memory.replicas:
        return None
    nodes = ranks.nodes
    if ranks.node is None or nodes is None or nodes < 2:
        raise ValueError(
            "memory=MemoryTier(replicas=1) keeps each memory save on another node too, and "
            + (
                "this job runs on one node"
                if nodes is not None
                else "this job's node layout is unknown (LOCAL_RANK differs from the rank but "
                "no LOCAL_WORLD_SIZE/GROUP_RANK or Distributed(node_rank=, ranks_per_node=) "
                "says how many ranks each node runs)"
            )
            + ": use replicas=0 here"
        )
    node, per = ranks.node.node_rank, ranks.node.ranks_per_node
    return ReplicaConfig(
        peer=peer_rank(ranks.rank, node, per, nodes),
        source=source_rank(ranks.rank, node, per, nodes),
    )


def node_local(ranks: Ranks, opts: EngineOptions) -> bool:
    """Node-local roots on several nodes: each node's local rank 0 commits (node_commit.py)."""
    nodes = ranks.nodes
    return opts.distributed.storage == "local" and nodes is not None and nodes > 1


def check_node_local(ranks: Ranks, opts: EngineOptions, remote: RemoteTier | None) -> None:
    """What needs every rank's files in one root is refused on node-local roots, before
    anything is written: an upload (each node would publish its own part under the step's
    name) and an export (rank 0's node holds only its ranks' shards)."""
    if not node_local(ranks, opts):
        return
    for what, given in (("a remote tier (remote=, a URL root)", remote), ("export=", opts.export)):
        if given is not None:
            raise ValueError(
                f'{what} is not supported with Distributed(storage="local") on several nodes: '
                "each node's root holds only its own ranks' files (and rank 0's); save to one "
                'root every node writes (storage="shared") for it'
            )
