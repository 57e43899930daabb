"""DCP's ``.metadata``, read once per checkpoint and cached (a load reads it three times),
the key paths it records, and the warning filter every DCP call here runs under.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from asyncckpt.core import layout as L
from asyncckpt.core.cachekeys import metadata_file_key
from asyncckpt.core.tree import PathItem

#: The last few ``.metadata`` files read, by (path, inode, mtime, size): a load reads the
#: metadata for the pre-load check, for the targets and for DCP itself; for a state of 20,000
#: tensors each unpickling takes ~0.5 s. Committed checkpoints never change in place.
_METADATA_CACHE: OrderedDict[tuple, Any] = OrderedDict()
_METADATA_CACHE_SIZE = 2
_metadata_lock = threading.Lock()


def read_dcp_metadata(directory: str | os.PathLike) -> Any:
    """DCP's ``Metadata`` of the checkpoint in ``directory`` (read once, then cached)."""
    key = metadata_file_key(Path(directory) / L.DCP_METADATA)
    with _metadata_lock:
        if key in _METADATA_CACHE:
            _METADATA_CACHE.move_to_end(key)
            return _METADATA_CACHE[key]
    metadata = FileSystemReader(directory).read_metadata()
    with _metadata_lock:
        _METADATA_CACHE[key] = metadata
        while len(_METADATA_CACHE) > _METADATA_CACHE_SIZE:
            _METADATA_CACHE.popitem(last=False)
    return metadata


def paths_from_dcp(metadata: Any) -> dict[str, list[PathItem]]:
    """Each key's typed path in the nested state, from DCP's ``planner_data`` (a checkpoint
    written by another tool): dict keys as str, list indices as int."""
    planner_data = metadata.planner_data or {}
    out = {}
    for fqn in metadata.state_dict_metadata:
        obj_path = planner_data.get(fqn, (fqn,))
        out[fqn] = [("l", k) if isinstance(k, int) else ("d", k) for k in obj_path]
    return out


@contextmanager
def quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process save/load that torch.distributed is not initialised;
    # for us that is the normal case, not news.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
