"""Ranks and nodes: how the workers of a job meet, agree and trust each other.

- ``dist``: the side group and side store the workers agree on every commit over; object collectives.
- ``framing``: worker-to-worker connections: the mutual handshake, JSON headers and byte segments.
- ``peerdata``: values from another process, decoded by type and signed (``SignedStore``), never unpickled.
- ``sidekeys``: the side store's per-save keys, removed once no rank can still read them.
- ``peer_gone``: a rank's worker that died with its trainer, told to the workers waiting for it.
- ``node_commit``: the commit of one step across node-local roots of several nodes.
- ``recovery_store``: the side store of a recovery at the trainers' death on node-local roots.
- ``local_recovery``: which step every rank of node-local roots loads, and fetching it from a peer.
"""
