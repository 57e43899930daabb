"""On-disk formats: how a flat state becomes files in a directory, and back.

``dcp`` is plain torch.distributed.checkpoint. ``torch_dist`` (Megatron dist_checkpointing)
and ``megatron_legacy`` (``--ckpt-format torch``) build on it.
"""

FORMATS = ("dcp", "torch_dist")


def default_format(layout: str) -> str:
    return "torch_dist" if layout == "megatron" else "dcp"
