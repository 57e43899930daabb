"""On-disk formats: how a flat state becomes files in a directory, and back.

``dcp`` is plain torch.distributed.checkpoint. ``torch_dist`` (Megatron dist_checkpointing)
and ``megatron_legacy`` (``--ckpt-format torch``) build on it.
"""

FORMATS = ("dcp", "torch_dist", "megatron_legacy")
#: Other spellings accepted for ``format=`` ("torch" is Megatron-LM's ``--ckpt-format torch``).
FORMAT_ALIASES = {"torch": "megatron_legacy", "legacy": "megatron_legacy"}


def default_format(layout: str) -> str:
    return "torch_dist" if layout == "megatron" else "dcp"
