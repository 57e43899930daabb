"""The shared vocabulary, below every other wing: what a state, a shard, a save and a name on
disk are. Nothing here does I/O beyond reading a directory's names.

- ``tree``: the state tree walked as DCP walks it: flattened for a save, rebuilt and merged back for a load.
- ``entries``: what a state or a checkpoint holds, by DCP key (the two sides a load's check compares).
- ``shards``: shard types: where a rank's pieces sit in a global tensor (``ShardInfo``, ``LocalShard``).
- ``savejob``: what the trainer hands its worker for one save (``SaveJob``, ``TensorSpec``).
- ``messages``: the messages between the trainer and its worker, one class each.
- ``layout``: names on disk: checkpoint directories, trackers, temporaries, trash, per layout.
- ``paths``: checks on the checkpoint root a user gives.
- ``cachekeys``: every cache of a plan, layout or template, and the key it is kept under.
- ``progress``: progress of long reads (``verify``, the check before a prune deletes).
- ``walltime``: wall time spent in spans that several threads may be in at once.
"""
