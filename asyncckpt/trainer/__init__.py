"""The engine's parts in the training process: what ``save`` and ``load`` do before and after the
worker.

- ``parts``: ``EngineParts``: one engine composed of its parts, and its lifecycle.
- ``ranks``: where an engine sits in the job, and what follows from it.
- ``roots``: where an engine's checkpoints live: local root, remote tier, spool.
- ``checks``: checks of options that travel to the worker, made at construction.
- ``saving``: ``Saver``: validation, a stager's slot, the hand-off to the worker.
- ``stagers``: the disk slots as a ``Stager`` (``DiskSlots``).
- ``steps``: how the facades run the blocking work (in place or in a thread).
- ``jobs``: ``JobTable``: the saves in flight, their handles and slots, how each ends.
- ``pins``: ``engine.protect(step)`` reaching a prune on its way, the trainer's side.
- ``pause``: ``PauseHooks``: the background write held while an optimizer steps.
- ``supervisor``: the worker's process: the root's locks, its start, its events, its death.
- ``earlier_worker``: a restart that does not wait for the worker a killed trainer left: where
  loads wait for it instead.
- ``preemption``: SIGTERM turned into "drain the staged saves, then one last save".
- ``restore``: ``Restorer``: the newest good checkpoint found, checked, read.
- ``local_load``: the load on node-local roots of several nodes.
- ``ledger``: ``GoodputMeter``: the engine's start, loads, saves and step time, in the root's goodput ledger.
- ``autoschedule``: ``Schedule(mtbf=)``: the save intervals chosen from measurements (Young/Daly).
"""
