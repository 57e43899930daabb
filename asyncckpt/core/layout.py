"""Names on disk: checkpoint directories, trackers, temporaries and trash, per layout.

Everything that decides *what a name means* lives here, so the engine, the pruner, the CLI and
``verify`` agree on it. Pure functions; nothing here touches the disk except ``scan``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

LAYOUTS = ("global_step", "megatron", "torchtitan")

#: Megatron-LM's tracker; verl and RLinf read the same name for the global_step layout.
TRACKER = "latest_checkpointed_iteration.txt"
#: SkyRL's tracker for the global_step layout, kept in step with ``TRACKER``.
SKYRL_TRACKER = "latest_ckpt_global_step.txt"
#: Written inside every checkpoint directory before it is committed.
MANIFEST = "asyncckpt_manifest.json"
#: Prefixes of names that are never checkpoints: in-flight writes and half-deleted ones.
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LOCK_NAME = ".asyncckpt.lock"
#: Where a checkpoint the engine found corrupt is moved (within the root, never deleted): it
#: stops counting as a checkpoint (listing, loading, retention, the forward check of steps).
QUARANTINE_DIR = ".quarantine"
#: Beside each quarantined directory: ``<its name>.json`` saying where it came from and why.
QUARANTINE_INFO_SUFFIX = ".json"
#: On an object store (no rename), a checkpoint is committed exactly when this object exists
#: in its prefix: written after every other file, deleted before them (storage/fsspec_store.py).
COMMIT_MARKER = ".asyncckpt-committed"

# Names inside a checkpoint directory, written by its format (``formats/``).
#: torch.distributed.checkpoint's metadata file (``dcp`` and ``torch_dist``): the index of
#: every stored item, written last by its rank 0.
DCP_METADATA = ".metadata"
#: The suffix of DCP's shard files (``__<rank>_<n>.distcp``; DCP's FileSystemWriter picks the
#: names, the loader goes by ``.metadata``'s index).
DCP_SHARD_SUFFIX = ".distcp"
#: Megatron ``torch_dist``: its config (written last: "this is a complete checkpoint") and the
#: common (non-sharded) state, beside DCP's files.
TORCH_DIST_CONFIG = "metadata.json"
TORCH_DIST_COMMON = "common.pt"
#: Megatron-LM's legacy per-rank files (``--ckpt-format torch``) in a rank directory named
#: ``LEGACY_RANK_DIR``, with ``LEGACY_PP_SUFFIX`` when pipeline parallel and
#: ``LEGACY_EP_SUFFIX`` when expert parallel (``mp_rank_01_002_005``).
LEGACY_MODEL = "model_optim_rng.pt"
LEGACY_DISTRIB_OPTIM = "distrib_optim.pt"
LEGACY_RANK_DIR = "mp_rank_{tp:02d}"
LEGACY_PP_SUFFIX = "_{pp:03d}"
LEGACY_EP_SUFFIX = "_{ep:03d}"

_PATTERNS = {
    # ASCII digits only: a str pattern's \d also matches other scripts' digits, which int()
    # reads ("global_step_\u0663" would be a second name of step 3).
    "global_step": re.compile(r"^global_step_(\d+)$", re.ASCII),
    "megatron": re.compile(r"^iter_(\d{7,})$", re.ASCII),
    # torchtitan's CheckpointManager writes ``{folder}/step-{N}``; anchored here, so
    # ``global_step_N`` is never read as one.
    "torchtitan": re.compile(r"^step-(\d+)$", re.ASCII),
}

#: What torchtitan's ``CheckpointManager._find_load_step`` looks for: ``re.search`` of this in
#: any entry of its folder holding a ``.metadata`` file. Unanchored, so no temporary or trash
#: name may contain it (``tmp_name`` / ``trash_name`` make sure of that).
TORCHTITAN_SEARCH = re.compile(r"step-(\d+)")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    return layout


def dir_name(layout: str, step: int) -> str:
    """The committed directory name of ``step``: ``global_step_N``, ``iter_NNNNNNN`` or
    ``step-N`` (torchtitan)."""
    check_layout(layout)
    if layout == "global_step":
        return f"global_step_{step}"
    if layout == "torchtitan":
        return f"step-{step}"
    return f"iter_{step:07d}"


def parse_dir_name(layout: str, name: str) -> int | None:
    """The step a committed directory name stands for, or None if it is not one."""
    m = _PATTERNS[check_layout(layout)].match(name)
    return int(m.group(1)) if m else None


def _unsearchable(name: str) -> str:
    # A temporary holds DCP's ``.metadata`` before its rename, and a trash entry still holds
    # it: torchtitan's unanchored ``step-(\d+)`` search must match neither, or it would pick a
    # step that is not (or no longer) there. ``step-5`` -> ``step_5``; other layouts' names
    # have no "-" and stay as they are.
    return name.replace("-", "_")


def tmp_name(layout: str, step: int, token: str) -> str:
    """A temporary directory beside the final one; never matches ``parse_dir_name`` (nor
    torchtitan's search, for any layout)."""
    return tmp_name_of(dir_name(layout, step), token)


def tmp_name_of(name: str, token: str) -> str:
    """The temporary of the entry ``name`` (``tmp_name`` for a checkpoint directory)."""
    return f"{TMP_PREFIX}{_unsearchable(name)}-{token}"


#: Beside a worker's temporary ``<tmp>``: ``<tmp>.writer-<rank>.json``, who writes it (pid,
#: host, rank, step, since when), so that ``ls`` tells a write in progress from a crash's
#: leftover. A leftover name itself (``TMP_PREFIX``): cleaned with its temporary.
WRITER_NOTE = ".writer-{rank}.json"


def writer_note_name(tmp: str, rank: int) -> str:
    return tmp + WRITER_NOTE.format(rank=rank)


def is_writer_note(name: str) -> bool:
    return name.startswith(TMP_PREFIX) and ".writer-" in name and name.endswith(".json")


def trash_name(name: str, token: str) -> str:
    return f"{TRASH_PREFIX}{_unsearchable(name)}-{token}"


def quarantine_name(name: str, reason: str, when: float) -> str:
    """The name of a quarantined checkpoint directory inside ``QUARANTINE_DIR``:
    ``global_step_1000-checksum-20250101T120000Z``. Never a checkpoint name (anchored
    patterns), and not a direct child of the root, so no scan of the root lists it."""
    import time

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
    return f"{name}-{reason}-{stamp}"


def tracker_names(layout: str) -> tuple[str, ...]:
    """Tracker files rewritten after each commit (the first is the one read back).

    torchtitan reads no tracker (it picks the highest ``step-N`` holding ``.metadata``), but
    the engine still writes Megatron's: it is how asyncckpt's own loader, ``ls`` and the
    pruner know the newest commit, and torchtitan's scan ignores a file of that name.
    """
    return (TRACKER, SKYRL_TRACKER) if check_layout(layout) == "global_step" else (TRACKER,)


def recovery_store_name(token: str) -> str:
    """The FileStore the workers of run ``token`` agree over after node loss (replication.py):
    a temporary, so a recovery cut short leaves a leftover the next start removes."""
    return f"{TMP_PREFIX}recovery-{token}.store"


def is_leftover(name: str) -> bool:
    """A temporary or trash entry left by a crash; removed at the next start."""
    return name.startswith(TMP_PREFIX) or name.startswith(TRASH_PREFIX)


@dataclass(frozen=True)
class CommittedDir:
    step: int
    path: Path


def scan(root: str | os.PathLike, layout: str) -> list[CommittedDir]:
    """Committed checkpoint directories under ``root``, oldest step first.

    A directory counts only if its name parses and it holds a manifest (written before the
    rename), so a foreign or hand-made directory with a matching name but no manifest is
    still listed only when it at least has DCP's ``.metadata`` (checkpoints written by other
    tools can be loaded too).
    """
    root = Path(root)
    out = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        step = parse_dir_name(layout, entry.name)
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        p = Path(entry.path)
        if (p / MANIFEST).exists() or (p / DCP_METADATA).exists():
            out.append(CommittedDir(step, p))
    out.sort(key=lambda c: c.step)
    return out


def read_tracker(root: str | os.PathLike) -> int | None:
    """The step the tracker names, or None if it is missing or not a step number."""
    try:
        text = (Path(root) / TRACKER).read_text().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    # (ASCII: "²" is a digit to str.isdigit and no number to int)
    return int(text) if text.isascii() and text.isdigit() else None


def detect_layout(root: str | os.PathLike, default: str = "global_step") -> str:
    """Which layout ``root`` uses, from its directory names; ``default`` for an empty root."""
    try:
        names = [e.name for e in os.scandir(os.fspath(root))]
    except FileNotFoundError:
        return default
    return pick_layout(names, root, default)


def pick_layout(names: list[str], where: object, default: str = "global_step") -> str:
    """The one layout the entry ``names`` of a root (``where``, for the message) belong to:
    ``default`` if none, ``ValueError`` if several (which to use cannot be guessed). Every
    store detects its layout by this rule."""
    found = [lay for lay in LAYOUTS if any(parse_dir_name(lay, n) is not None for n in names)]
    if len(found) > 1:
        raise ValueError(f"{where} holds directories of several layouts {found}; pass layout=")
    return found[0] if found else default
