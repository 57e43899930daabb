"""The trainer's copy of the state into reused buffers: the only work a save blocks training for.

- ``stager``: the ``Stager`` protocol (after DCP's ``AsyncStager``): how a save is staged and handed over.
- ``arenas``: staging slots of reused shared-memory (pinned) arenas, and the copy into them.
- ``flatplan``: the flattening of a state, recorded once per layout and replayed at every save.
- ``copyruns``: runs of small same-shape tensors copied by one ``torch.stack``.
- ``bytecheck``: the torn-state check from the bytes, for overlapped saves.
- ``unchanged``: differential saves, the trainer's half: unchanged tensors are not copied again.
- ``fingerprints``: the xxh3-128 fingerprint of a run of bytes, shared by both halves.
- ``fingerprint_kernel``: the device fingerprint's fused Triton kernel (optional).
- ``chunking``: which bytes of which tensors go into each chunk of a staging budget.
- ``chunked``: a state larger than ``Staging(max_host_bytes=)`` staged through the budget (``ChunkedStager``).
"""
