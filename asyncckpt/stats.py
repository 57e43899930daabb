"""The figures every save reports, for users' own overhead dashboards."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class SaveStats:
    step: int
    #: seconds ``save`` blocked copying the state into the staging arenas
    stage_seconds: float = 0.0
    #: seconds ``save`` waited for a free staging buffer (back-pressure)
    wait_seconds: float = 0.0
    #: seconds allocating arenas (first save of a layout; 0 once ``prepare`` ran)
    alloc_seconds: float = 0.0
    #: seconds the worker spent writing and fsyncing the shards
    write_seconds: float = 0.0
    #: seconds for manifest, rename and tracker
    commit_seconds: float = 0.0
    #: seconds of ``write_seconds`` the worker held its writes for ``pause_writes`` regions
    paused_seconds: float = 0.0
    #: bytes written (all files of the checkpoint)
    bytes: int = 0
    #: bytes staged (tensor data)
    staged_bytes: int = 0
    #: unix time at which the checkpoint committed
    committed_at: float | None = None
    path: str | None = None

    @property
    def blocked_seconds(self) -> float:
        """Total time ``save`` held the training loop."""
        return self.stage_seconds + self.wait_seconds + self.alloc_seconds

    @property
    def throughput_bytes_per_s(self) -> float:
        return self.bytes / self.write_seconds if self.write_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["blocked_seconds"] = self.blocked_seconds
        d["throughput_bytes_per_s"] = self.throughput_bytes_per_s
        return d
