"""The memory tier and hot resume, both sides: checkpoints kept in the worker's memory, replicated
to a peer node, and loaded from a surviving worker without reading the disk.

- ``service``: the ``WorkerService`` protocol, what a worker runs beside its write, and the worker as services see it.
- ``tier``: the trainer's side of the memory tier (``MemoryStager``): its slots and the hand-over.
- ``hold``: the worker's side: the newest complete memory save held, written when it must be.
- ``replication``: memory saves replicated to a peer node's worker; a stand-in for a gone node.
- ``jobwire``: a memory save's job on the wire, field by field, for a replica.
- ``hot_serve``: a hot resume, the worker's side: offering what it holds to the next trainer.
- ``hot_offer``: a hot resume's offer and its form on the socket.
- ``hot_resume``: a hot resume, the trainer's side: ``load_latest`` from a surviving worker's memory.
- ``hot_load``: a load straight from the offered memory, no file read.
- ``hot_agree``: several ranks take an offered step all from memory, or none of them.
"""
