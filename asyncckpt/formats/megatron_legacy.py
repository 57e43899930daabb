"""Megatron-LM's legacy per-rank checkpoint (``--ckpt-format torch``).

Layout, as ``megatron/training/checkpointing.py:get_checkpoint_name`` builds it::

    iter_0000050/                      (layout.dir_name("megatron", 50); the engine's part)
      mp_rank_00/model_optim_rng.pt    tensor parallel rank 0, no pipeline parallelism
      mp_rank_01_002/model_optim_rng.pt  TP rank 1, PP rank 2 (when PP size > 1)
      mp_rank_00_000_001/...             ... with expert parallelism: EP rank appended
      mp_rank_00/distrib_optim.pt      distributed-optimizer state, beside model_optim_rng.pt

Each file is one ``torch.save``; Megatron-LM reads it with ``torch.load(weights_only=False)``
because it holds ``argparse.Namespace`` and numpy RNG states. Every model-parallel rank writes
its own file (with a distributed optimizer, only data-parallel rank 0 of each model-parallel
group writes ``model_optim_rng.pt``); there is no global metadata, so a multi-rank save is
committed once every rank's files are durable.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from ..commit import write_synced

MODEL_FNAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FNAME = "distrib_optim.pt"


def legacy_rank_dir(
    tp_rank: int, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1
) -> str:
    """The per-rank directory name inside ``iter_NNNNNNN``; Megatron-LM's exact spelling."""
    if min(tp_rank, pp_rank, ep_rank) < 0 or pp_rank >= pp_size or ep_rank >= ep_size:
        raise ValueError(f"bad ranks tp={tp_rank} pp={pp_rank}/{pp_size} ep={ep_rank}/{ep_size}")
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep_size > 1 else "")


def _save_synced(obj: Any, path: Path) -> None:
    # Serialise in memory first: a pickling error must not leave a half-written file behind.
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_synced(path, buf.getbuffer())


def write_legacy(
    state: dict,
    directory: str | os.PathLike,
    tp_rank: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
    distrib_optim_key: str = "distrib_optim",
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> list[Path]:
    """Write this rank's files under ``directory`` (the ``iter_NNNNNNN`` dir); return them.

    ``state[distrib_optim_key]``, if present, goes to ``distrib_optim.pt`` and the rest to
    ``model_optim_rng.pt``; ``state`` itself is not modified.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    rank_dir = Path(directory) / legacy_rank_dir(tp_rank, pp_rank, pp_size, ep_rank, ep_size)
    model = {k: v for k, v in state.items() if k != distrib_optim_key}
    rank_dir.mkdir(parents=True, exist_ok=True)
    written = [rank_dir / MODEL_FNAME]
    _save_synced(model, written[0])
    if distrib_optim_key in state:
        written.append(rank_dir / DISTRIB_OPTIM_FNAME)
        _save_synced(state[distrib_optim_key], written[1])
    return written


def read_legacy(
    directory: str | os.PathLike,
    tp_rank: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
    distrib_optim_key: str = "distrib_optim",
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    weights_only: bool = False,
) -> dict:
    """Inverse of ``write_legacy``: the state, with ``distrib_optim.pt`` under its key.

    ``weights_only=False`` matches Megatron-LM's own loader (its files hold Namespaces and
    numpy RNG state); pass True for files from an untrusted source.
    """
    rank_dir = Path(directory) / legacy_rank_dir(tp_rank, pp_rank, pp_size, ep_rank, ep_size)
    state = torch.load(rank_dir / MODEL_FNAME, map_location="cpu", weights_only=weights_only)
    optim = rank_dir / DISTRIB_OPTIM_FNAME
    if optim.exists():
        state[distrib_optim_key] = torch.load(optim, map_location="cpu", weights_only=weights_only)
    return state
