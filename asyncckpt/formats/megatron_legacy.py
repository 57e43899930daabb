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

import os
from pathlib import Path
from typing import Any

import torch

from asyncckpt.core import layout as L
from asyncckpt.core.entries import Entries, walk
from asyncckpt.core.shards import is_dtensor
from asyncckpt.core.tree import is_stateful, merge_into
from asyncckpt.formats.base import (
    Crcs,
    Format,
    LoadOptions,
    Paths,
    Prepared,
    SaveOptions,
    WriteOptions,
)
from asyncckpt.formats.pt import save_synced
from asyncckpt.formats.staged import pickle_with_refs, state_dicts, unpickle_with_refs


def legacy_rank_dir(
    tp_rank: int, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1
) -> str:
    """The per-rank directory name inside ``iter_NNNNNNN``; Megatron-LM's exact spelling."""
    if min(tp_rank, pp_rank, ep_rank) < 0 or pp_rank >= pp_size or ep_rank >= ep_size:
        raise ValueError(f"bad ranks tp={tp_rank} pp={pp_rank}/{pp_size} ep={ep_rank}/{ep_size}")
    name = L.LEGACY_RANK_DIR.format(tp=tp_rank)
    if pp_size > 1:
        name += L.LEGACY_PP_SUFFIX.format(pp=pp_rank)
    return name + (L.LEGACY_EP_SUFFIX.format(ep=ep_rank) if ep_size > 1 else "")


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
    written = [rank_dir / L.LEGACY_MODEL]
    save_synced(model, written[0])
    if distrib_optim_key in state:
        written.append(rank_dir / L.LEGACY_DISTRIB_OPTIM)
        save_synced(state[distrib_optim_key], written[1])
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
    return _read_rank_dir(rank_dir, distrib_optim_key, weights_only=weights_only)


def _read_rank_dir(
    rank_dir: Path, distrib_optim_key: str, *, weights_only: bool, mmap: bool = False
) -> Any:
    def load(p: Path) -> Any:
        return torch.load(p, map_location="cpu", weights_only=weights_only, mmap=mmap)

    state = load(rank_dir / L.LEGACY_MODEL)
    optim = rank_dir / L.LEGACY_DISTRIB_OPTIM
    if isinstance(state, dict) and optim.exists():
        state[distrib_optim_key] = load(optim)
    return state


# ------------------------------------------------------------------------------ the format


class MegatronLegacyFormat(Format):
    """Each rank's state dict pickled with its tensors staged (the trainer may go on), then
    ``torch.save``d by the worker into this rank's ``mp_rank_*`` directory. No collective:
    a multi-rank save is committed once every rank's files are durable."""

    name = "megatron_legacy"

    def prepare(self, state: Any, options: SaveOptions) -> Prepared:
        # State dicts, not the objects: Megatron-LM's files hold state dicts, and the load then
        # restores the caller's modules and optimizers in place (load_state_dict).
        state = state_dicts(state)
        if not isinstance(state, dict):
            raise TypeError(
                f"format megatron_legacy needs a dict state, not {type(state).__name__}"
            )
        skeleton: bytes = b""
        tensors: dict[Any, Any] = {}
        if options.legacy.write:
            skeleton, tensors = pickle_with_refs(state, L.LEGACY_MODEL)
        for k, t in tensors.items():
            if is_dtensor(t):
                raise TypeError(f"format megatron_legacy stores per-rank files; {k} is a DTensor")
        return Prepared(tensors, {}, {}, {"skeleton": skeleton, "ranks": options.legacy})

    def write(self, part: Prepared, location: Path, options: WriteOptions) -> Crcs:
        ranks = part.extra["ranks"]
        if ranks.write:
            state = unpickle_with_refs(part.extra["skeleton"], part.tensors)
            write_legacy(
                state, location, ranks.tp_rank, ranks.pp_rank, ranks.pp_size,
                ranks.distrib_optim_key,
            )  # fmt: skip
        return {}

    def load_into(self, state: Any, location: Path, paths: Paths, options: LoadOptions) -> None:
        r = options.legacy
        loaded = read_legacy(location, r.tp_rank, r.pp_rank, r.pp_size, r.distrib_optim_key)
        if is_stateful(state):
            state.load_state_dict(loaded)
        else:
            merge_into(state, loaded)

    def entries(self, state: Any, location: Path, options: LoadOptions) -> Entries:
        """This rank's files, read memory-mapped (tensor data untouched); same trust as
        Megatron-LM's loader (and ``read_legacy``): weights_only=False."""
        r = options.legacy
        rank_dir = location / legacy_rank_dir(r.tp_rank, r.pp_rank, r.pp_size)
        return walk(_read_rank_dir(rank_dir, r.distrib_optim_key, weights_only=False, mmap=True))

    def read_by_check(self, path: Path, location: Path) -> bool:
        return location in path.parents  # the check reads the files themselves
