"""The engine's checks of options that travel to the worker process: refused at the
engine's construction, not at the first save after a step of training."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from asyncckpt.worker.export import HFExport, _require_safetensors


def check_export(export: HFExport | None, root: Path) -> None:
    """``export=``: an ``HFExport`` into a directory of its own, with safetensors installed."""
    if export is None:
        return
    if not isinstance(export, HFExport):
        raise TypeError(f"export must be an HFExport, not {export!r}")
    # The export's own steps, tracker and pruning in the checkpoint root would write into
    # committed checkpoints and delete them by the export's keep.
    if os.path.realpath(export.path) == os.path.realpath(root):
        raise ValueError(
            f"HFExport(path={os.fspath(export.path)!r}) is the checkpoint root: the export "
            "needs a directory of its own (its steps, tracker and pruning are its own)"
        )
    _require_safetensors()  # here, not in the worker after the first due step has committed


def check_picklable(**options: Any) -> None:
    """What travels to the worker process must pickle: refused here, not at the first save."""
    for name, value in options.items():
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 - pickle raises many types
            raise TypeError(
                f"{name}= must be picklable (it runs in the checkpoint worker process): "
                f"{type(e).__name__}: {e}; define it at module level, with no lambdas"
            ) from e
