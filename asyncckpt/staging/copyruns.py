"""The copy plan of a slot's small tensors: runs of one shape copied by one ``torch.stack``.

On the CPU ``torch._foreach_copy_`` copies tensor by tensor through the dispatcher: at 20,000
tensors of 4 KiB that is ~2 us each, most of it not the bytes. Where consecutive tensors of a
slot have the same dtype and shape and sit back to back in one arena (the arena is laid out
in the state's order), ``torch.stack(run, out=block)`` copies the run with one dispatch and a
memcpy per tensor (measured here: 16 tensors 9.3 us -> 5.4 us, 20,000: ~1.5x faster). The
other small tensors still go through one ``_foreach_copy_``.

Which runs exist depends only on where the tensors sit (the arena layout), so the plan is made
once per layout, with the slot's views, and dropped with them (``staging.StagingSlot.ensure``
re-plans on every new layout key). A source whose dtype or shape is not its spec's never gets
here: the layout key (fresh flattening) or the flatten plan's replay (dtypes and shapes) send
such a state to a new layout first; and where one changes during the copy (a torn state),
``stack`` refuses the mismatch rather than broadcasting it as a copy may.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncckpt._torch import foreach_copy_

#: Shortest run copied by ``stack``: at 2 tensors it costs what ``_foreach_copy_`` does; from
#: 4 it is faster (2.3 vs 2.8 us), and the gap grows with the run.
MIN_RUN = 4


class Placed(Protocol):
    """Where a tensor sits in a slot (``staging.TensorSpec``)."""

    @property
    def arena(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass
class SmallCopyPlan:
    """How the slot's small tensors (the ``srcs`` of ``copy``, in the slot's order) are copied."""

    # (start, stop, block, row): srcs[start:stop], each of shape ``row``, -> block
    runs: list[tuple[int, int, torch.Tensor, torch.Size]]
    singles: list[int]  # positions in srcs copied by one _foreach_copy_
    single_views: list[torch.Tensor]
    stacked: int  # tensors copied by runs (tests and benchmarks read it)

    @classmethod
    def build(
        cls,
        specs: Sequence[Placed],
        views: Sequence[torch.Tensor],
        arenas: Sequence[torch.Tensor],
        min_run: int = MIN_RUN,
    ) -> SmallCopyPlan:
        """The plan for tensors placed at ``specs`` (their arena ``views``), in that order."""
        runs: list[tuple[int, int, torch.Tensor, torch.Size]] = []
        singles: list[int] = []
        start = 0
        for i in range(1, len(specs) + 1):
            if i < len(specs) and _follows(specs[i - 1], specs[i]):
                continue
            if i - start >= min_run:
                first = specs[start]
                raw = arenas[first.arena][first.offset : first.offset + (i - start) * first.nbytes]
                block = raw.view(first.dtype).view(i - start, *first.shape)
                runs.append((start, i, block, torch.Size(first.shape)))
            else:
                singles.extend(range(start, i))
            start = i
        return cls(runs, singles, [views[i] for i in singles], len(specs) - len(singles))

    def copy(self, srcs: list[torch.Tensor]) -> None:
        """Copy ``srcs`` (CPU tensors, one per spec the plan was built for) into their views."""
        with torch.no_grad():  # out= refuses tensors that require grad outside no_grad
            for start, stop, block, row in self.runs:
                first = srcs[start]
                # ``out=`` resizes a block its sources do not fit, and resizing shared memory
                # crashes the process: check the run's first source (``stack`` itself refuses
                # a run whose tensors differ in size, before it touches ``out``). The state
                # was checked when ``save`` was called; this is a change since (torn).
                if first.shape != row or first.dtype != block.dtype:
                    raise RuntimeError(
                        f"tensors {start}..{stop - 1} of the state changed dtype or shape "
                        "while staged"
                    )
                torch.stack(srcs[start:stop], out=block)
            if self.singles:
                if len(self.singles) == len(srcs):  # no run (mixed shapes): no gather
                    foreach_copy_(self.single_views, srcs)
                else:
                    foreach_copy_(self.single_views, [srcs[i] for i in self.singles])


def _follows(prev: Placed, spec: Placed) -> bool:
    # Back to back in one arena, one dtype and shape: the run's bytes are one block.
    return (
        spec.arena == prev.arena
        and spec.offset == prev.offset + prev.nbytes
        and spec.dtype == prev.dtype
        and spec.shape == prev.shape
        and spec.nbytes > 0
    )


def empty_plan() -> SmallCopyPlan:
    """The plan of a slot with no layout yet."""
    return SmallCopyPlan([], [], [], 0)
