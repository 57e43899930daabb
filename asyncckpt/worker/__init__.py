"""The worker wing: the background process that writes, agrees, commits and prunes.

- loop.py: ``Worker``, its loop over the trainer's messages and each save's write and commit.
- main.py: ``worker_main``, the process's start, its services composed; a stand-in's work.
- entry.py: ``run_worker``, what the trainer spawns: it imports ``main`` in the worker.
- config.py: ``WorkerConfig`` (what a worker starts with) and ``PruneRequest``.
- report.py: what a worker tells its trainer (a failure's info, the events pipe).
- pins.py: the worker's side of ``engine.protect`` (``WorkerPins``, the ``Pins`` service).
- services.py: the export as a service beside the write (``Export``).
- chunked_write.py: a save staged in chunks, written chunk by chunk as the trainer copies.
- export.py, export_source.py: Hugging Face safetensors export of a committed step.
- stand_in.py: a stand-in process, the worker of a rank whose node is gone.
"""
