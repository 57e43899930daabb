"""Every private part of torch that asyncckpt uses, in one place, each guarded.

torch renames its private names between releases. Here each one is looked up once, by
``getattr`` where that is possible, and where a release lacks it the public way is taken
instead: correct, maybe slower, and never silent. Every such fallback is counted in
``fallbacks`` (by name; ``SaveStats`` and the load report carry the counts of their own fast
paths) and logged once per process on the ``asyncckpt`` logger.

What has no public way (DCP's ``_StorageInfo``, which ``.metadata`` pickles by its path) is
looked up here too (``storage_info_class``), so a torch without it fails at ``import
asyncckpt.formats.dcp.writer`` naming it.
The ``torch.save`` record reader and writer (``formats/records.py``) use public API only; their
fallbacks to ``torch.save``/``torch.load`` have counters of their own (``SaveStats`` and
``LoadReport.records_fallbacks``).
"""

from __future__ import annotations

import logging
import operator
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("asyncckpt")

#: How often each private part was missing and its public fallback taken, by name.
fallbacks: Counter[str] = Counter()
_logged: set[str] = set()
_lock = threading.Lock()


def fell_back(name: str, instead: str) -> None:
    """Count a fallback from torch's private ``name`` to ``instead``; log it once."""
    with _lock:
        fallbacks[name] += 1
        first = name not in _logged
        _logged.add(name)
    if first:
        log.warning(
            "torch %s has no %s: asyncckpt uses %s instead (correct, may be slower)",
            torch.__version__,
            name,
            instead,
        )


# ------------------------------------------------------------------------------- copies


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, in one call (``torch._foreach_copy_``) where torch
    has it: thousands of small tensors cost one dispatch instead of thousands."""
    fn = getattr(torch, "_foreach_copy_", None)
    if fn is None:
        fell_back("torch._foreach_copy_", "one copy_ per tensor")
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
        return
    fn(dst, src)


_VERSION = operator.attrgetter("_version")


def version_counters(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Each tensor's in-place version counter (``Tensor._version``: bumped by every in-place
    op through autograd's view of it); empty where torch has none (torn states go unseen).
    A tensor made under ``torch.inference_mode`` has none: ``INFERENCE`` stands for it (its
    writes, possible only inside that mode, move nothing, as ``.data`` writes)."""
    tensors = list(tensors)
    try:
        return list(map(_VERSION, tensors))
    except AttributeError:
        fell_back("Tensor._version", "no check for tensors modified while staged")
        return []
    except RuntimeError:  # "Inference tensors do not track version counter"
        return [INFERENCE if t.is_inference() else t._version for t in tensors]


#: The version counter ``version_counters`` gives an inference tensor (it has none).
INFERENCE = -1


def host_register(ptr: int, nbytes: int) -> None:
    """Page-lock existing host memory in place (``cudaHostRegister``): pinned without a copy."""
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed with code {int(rc)}")


def host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


# ---------------------------------------------------------------------------------- DCP

# ------------------------------------------------------------------------ tensor subclasses


def make_wrapper_subclass(cls: type, shape: torch.Size, dtype: torch.dtype) -> Any:
    """A tensor of type ``cls``, of ``shape`` and ``dtype``, with no storage of its own
    (``torch.Tensor._make_wrapper_subclass``: how torch documents wrapper subclasses, with no
    public stand-in); ``core.shards.LocalShard`` carries its pieces beside it."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype)


def or_dcp_error(*errors: type[BaseException]) -> tuple[type[BaseException], ...]:
    """``errors`` and DCP's ``CheckpointException``, for an ``except`` clause (it derives from
    BaseException, past ``except Exception``). DCP's is left out while
    ``torch.distributed.checkpoint`` is not imported: nothing can have raised it then, and
    importing it costs a trainer about a second."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    dcp = getattr(api, "CheckpointException", None)
    if isinstance(dcp, type) and issubclass(dcp, BaseException):
        return (*errors, dcp)
    return errors


def storage_info_class() -> type:
    """DCP's ``_StorageInfo``, pickled into every ``.metadata`` by its path: there is no public
    stand-in. Looked up when the DCP writer is imported (in the worker), not with asyncckpt:
    ``torch.distributed.checkpoint`` costs a trainer about a second to import."""
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    except ImportError as e:  # pragma: no cover - a torch release that renamed it
        raise ImportError(
            f"torch {torch.__version__} has no torch.distributed.checkpoint.filesystem."
            "_StorageInfo, which asyncckpt's DCP writer records in .metadata; use torch >= 2.9 "
            "as pyproject.toml says, or report this torch version"
        ) from e
    return _StorageInfo


@contextmanager
def stateful_entries_as_is() -> Iterator[None]:
    """Within it, ``dcp.save`` takes a flat dict's top-level entries as they are (its private
    ``_stateful_to_state_dict`` pass, ~1 s at 20,000 entries, returns a shallow copy of a
    state with no Stateful entry anyway). Without that function, ``dcp.save`` runs as is."""
    from torch.distributed.checkpoint import state_dict_saver as saver

    original = getattr(saver, "_stateful_to_state_dict", None)
    if original is None:
        fell_back("state_dict_saver._stateful_to_state_dict", "dcp.save's own pass")
        yield
        return
    saver._stateful_to_state_dict = dict  # type: ignore[assignment]  # a shallow copy, as it does
    try:
        yield
    finally:
        saver._stateful_to_state_dict = original


def inner_dcp_load() -> Any:
    """DCP's loader below ``dcp.load``'s per-key Stateful check (~25 us a key), or None
    (then ``dcp.load`` itself is called)."""
    from torch.distributed.checkpoint import state_dict_loader

    inner = getattr(state_dict_loader, "_load_state_dict", None)
    if inner is None:
        fell_back("state_dict_loader._load_state_dict", "dcp.load")
    return inner


def dcp_plan_caches() -> list[dict]:
    """DCP's class-level plan caches (what it keeps per ``_cached_plans_key``); those missing
    are left out (a cache key then only ever misses)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    names = (
        "_cached_save_plan",
        "_cached_all_plans",
        "_cached_global_plan",
        "_cached_metadata",
        "_cached_final_save_plan",
    )
    caches = [getattr(SavePlanner, n, None) for n in names]
    return [c for c in caches if isinstance(c, dict)]


def dcp_plan_cache(name: str) -> dict:
    """One of DCP's plan caches by its name; an empty dict (always a miss) if torch lacks it."""
    from torch.distributed.checkpoint.planner import SavePlanner

    cache = getattr(SavePlanner, name, None)
    if not isinstance(cache, dict):
        fell_back(f"SavePlanner.{name}", "planning every save afresh")
        return {}
    return cache
