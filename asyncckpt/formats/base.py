"""The ``Format`` protocol: what the engine asks of an on-disk format, and what it hands over.

A format is one stateless object with a few small operations, in the spirit of
torch.distributed.checkpoint's ``StorageWriter`` / ``SavePlanner``:

- ``prepare`` (trainer, while ``save`` blocks): split the state into the tensors to stage
  (copied into the staging arenas, so the loop may go on), objects serialised now, and a
  picklable ``extra`` that travels with the job;
- ``write`` (worker, a spawned process): put the staged views back together and write them
  into a directory, collectively when a process group is given;
- ``entries`` (trainer, before a load): what the checkpoint holds, compared with the target
  before a byte of it is overwritten (``loadcheck.check``); ``read_by_check`` names the files
  that comparison reads (verified first);
- ``load_into``: restore the checkpoint into the caller's state, in place;
- ``read`` (optional): the saved state as a new dict, without a target (``reading.py``).

Formats are registered by name (``asyncckpt.formats.register_format``); the engine, the
worker, components and loads look them up there. Nothing here imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from asyncckpt.core.entries import Entries

#: (checksum, size) of each file a format wrote, by path (see ``Format.write``).
Crcs = dict[str, tuple[int, int]]
#: Typed paths by key, as ``Prepared.paths`` (the manifest's); None without a manifest.
Paths = Mapping[str, list] | None


@dataclass
class Prepared:
    """One save's state, split for staging (trainer side)."""

    tensors: Mapping[str, torch.Tensor]  # staging key -> dense local tensor (to an arena)
    objects: Mapping[str, bytes] = field(default_factory=dict)  # key -> torch.save bytes
    paths: Mapping[str, list] = field(default_factory=dict)  # key -> typed path (manifest)
    extra: Mapping[str, Any] = field(default_factory=dict)  # picklable, travels with the job
    key: tuple | None = None  # staging.layout_key(tensors), where already known


@dataclass(frozen=True)
class LegacyRanks:
    """Where this rank's files go in Megatron-LM's legacy layout, and whether it writes."""

    tp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    write: bool = True
    distrib_optim_key: str = "distrib_optim"


@dataclass(frozen=True)
class SaveOptions:
    """What ``Format.prepare`` may need besides the state."""

    legacy: LegacyRanks = LegacyRanks()  # megatron_legacy: this rank's place
    cache: Any = None  # flatplan.FlattenCache: the last save's flattening, replayed (dcp)
    writes: bool = True  # whether this rank writes the part (a one-file format: rank 0's)
    what: str | None = None  # the part, as errors name it ("component 'data'")


@dataclass(frozen=True)
class WriteOptions:
    """What ``Format.write`` gets from the worker besides the data."""

    rank: int = 0  # this worker's rank in ``process_group``
    process_group: Any = None  # the workers' side group; None: one process writes it all
    thread_count: int = 1
    pace: Callable[[int], None] | None = None  # the throttle, per piece of bytes written
    direct_io: bool = False
    plan_cache: str | None = None  # names what is written again and again (dcp's plan cache)
    #: differential.Previous: link unchanged files from the previous checkpoint; None: off
    differential: Any = None
    #: the writers append how many files each wrote at once (``SaveStats.io_threads``: what
    #: ran, not what was asked: fewer files than threads, or a one-file format, use fewer)
    threads_used: list[int] | None = None


class Verify:
    """Files of a checkpoint for a format's reader to check against the manifest while it
    reads them (``Format.verifies_while_reading``): ``files`` maps a name in the part's
    directory to its manifest entry; the reader adds each file it checked to ``done``."""

    def __init__(self, files: Mapping[str, Any]) -> None:
        self.files = dict(files)
        self.done: set[str] = set()


@dataclass(frozen=True)
class LoadOptions:
    """What ``Format.entries`` / ``load_into`` may need besides the state and the place."""

    legacy: LegacyRanks = LegacyRanks()  # megatron_legacy: which rank's files
    weights_only: bool = True  # how a file of pickles is read (pt)
    verify: Verify | None = None  # files to check while reading (verifies_while_reading)
    # Read only the entries the target names (a load that skips keys, restore._load_partial):
    # other ranks' entries may not be on this disk (node-local storage, node_commit.py).
    target_only: bool = False


class Format(ABC):
    """An on-disk format (see the module docstring). Subclass it, set ``name``, implement
    ``prepare``, ``write`` and ``load_into``, and register an instance with
    ``asyncckpt.formats.register_format``. The instance travels to the worker by pickle, so
    its class must be importable there (not defined in the trainer's ``__main__``)."""

    #: The name given as ``format=`` or ``Component(format)``, recorded in the manifest.
    name: ClassVar[str]
    #: True: ``load_into`` checks the files of ``LoadOptions.verify`` against their manifest
    #: entries as it reads them (raising ``manifest.ChecksumMismatch`` before it applies
    #: anything it does not read in place), so the restorer does not read them first.
    verifies_while_reading: ClassVar[bool] = False
    #: True: a part in this format is a directory it owns (a whole checkpoint, or a
    #: component's); False: one file, which only a component can be (its path may name the
    #: rank, every rank writing its own).
    owns_directory: ClassVar[bool] = True
    #: True: every rank's part lands in one checkpoint all ranks share (DCP's), so a rank's
    #: load target may lack keys another rank saved; False: a rank reads its own file.
    shared_by_ranks: ClassVar[bool] = False
    #: True: ``write`` honours ``WriteOptions.differential`` (links unchanged files).
    differential: ClassVar[bool] = False

    @abstractmethod
    def prepare(self, state: Any, options: SaveOptions) -> Prepared:
        """Trainer side, while ``save`` blocks: the dense tensors to stage, everything else
        serialised now (a snapshot; a bad state fails here, before anything is written)."""

    @abstractmethod
    def write(self, part: Prepared, location: Path, options: WriteOptions) -> Crcs:
        """Worker side: write this rank's part into ``location`` (an existing directory, or
        for a one-file format the file, its directory not yet made). ``part`` is what
        ``prepare`` returned as the worker has it: ``tensors`` are the staged copies (views of
        the staging arenas, by the same keys), ``objects``, ``paths`` and ``extra`` as
        prepared.

        Returns (checksum, size) of each file it wrote, by path relative to ``location`` (a
        one-file format: relative to its directory): a multi-rank worker makes those durable
        (a file the format synced itself may be left out; the manifest checksums what is not
        listed). With ``options.process_group`` every rank calls it for the same place.
        ``objects`` values may be a ``bytes`` subclass (``dcp.Serialized``)."""

    @abstractmethod
    def load_into(self, state: Any, location: Path, paths: Paths, options: LoadOptions) -> None:
        """Restore the checkpoint at ``location`` into ``state`` in place; ``paths`` are
        ``Prepared.paths`` as the manifest recorded them (None without a manifest)."""

    def entries(self, state: Any, location: Path, options: LoadOptions) -> Entries | None:
        """What the checkpoint holds, to compare ``state`` with before a load
        (``loadcheck.check``); None: nothing to compare with, the read will say."""
        return None

    def read_by_check(self, path: Path, location: Path) -> bool:
        """True for a file ``path`` of the part at ``location`` that ``entries`` reads (its
        checksum is verified before the check trusts it)."""
        return False

    def read(self, location: Path, paths: Paths) -> dict[str, Any]:
        """The saved state as a new nested dict, tensors on the CPU (no target)."""
        raise NotImplementedError(f"format {self.name!r} cannot be read without a target")

    @classmethod
    def reads_without_target(cls) -> bool:
        """Whether ``read`` is implemented (``asyncckpt.formats.reading.read_checkpoint``)."""
        return cls.read is not Format.read
