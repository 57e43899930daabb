"""Optional adapters for training frameworks; each imports its framework lazily.

- ``lightning``: an asynchronous ``CheckpointIO`` plugin and a ``ModelCheckpoint`` for Lightning.
- ``hf``: asynchronous saves from a Hugging Face ``transformers.Trainer`` callback, and its load.
- ``dcp``: a model and its optimizer the way torch.distributed.checkpoint names them.
"""
