"""Components: several formats in one checkpoint, committed together.

The RL frameworks write one step as sub-directories and files, each in its own format, and
resume from the step as a whole::

    SkyRL   global_step_10/policy/ critic/ (model, optimizer, scheduler) data.pt trainer_state.pt
    RLinf   global_step_50/actor/iter_0000050/mp_rank_00/model_optim_rng.pt
                          actor/latest_checkpointed_iteration.txt   data/data.pt

``CheckpointEngine(root, components={...})`` saves a state ``{name: part}``: each part is
written in its component's format at its path inside the step's temporary directory, one
manifest covers every file, and the step is committed by one rename (invariant 1 for the
step as a whole: a crash never leaves a step with a policy and no critic). Ready-made specs
for SkyRL and RLinf are in ``asyncckpt.frameworks``.

Everything here is pure but ``write`` (the worker) and ``load_parts`` (which reads a
manifest-less checkpoint's spec from the engine).
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncckpt.core import layout as _layout
from asyncckpt.errors import NotSerializable, StateMismatch
from asyncckpt.formats import check_format, format_names, format_of, get_format, prepare_part
from asyncckpt.formats.base import LegacyRanks, Prepared, SaveOptions
from asyncckpt.storage.commit import write_synced
from asyncckpt.storage.manifest import checksum

#: The engine's format name for a checkpoint made of components (recorded in its manifest).
#: Not a registered format: its parts are, each written in its own (``write``).
COMPONENTS = "components"


@dataclass(frozen=True)
class Component:
    """One part of a step: its format and where it goes inside the step directory.

    ``format`` is any registered format (``asyncckpt.formats.format_names()``). ``path`` is
    relative to the step directory (``global_step_N/``) and may use ``{step}``
    (``"actor/iter_{step:07d}"``) and, for ``pt`` files written by every rank, ``{rank}`` and
    ``{world_size}``; by default it is the component's name. A ``dcp``, ``torch_dist`` or
    ``megatron_legacy`` component (a format that ``owns_directory``) owns the directory at its
    path; a ``pt`` component is one file there (written by rank 0 only, unless its path uses
    ``{rank}``).

    ``tracker``: a file (relative to the step directory) holding the step number, written
    with the component: RLinf points Megatron-LM's ``--load`` at ``global_step_N/actor``,
    which reads ``actor/latest_checkpointed_iteration.txt``.

    ``weights_only``: how a ``pt`` file is read back (``torch.load``'s safe default); set it to
    False for files holding objects other than tensors, containers and plain values (numpy
    arrays, a config object), and only for files you trust.
    """

    format: str = "dcp"
    path: str | None = None
    tracker: str | None = None
    weights_only: bool = True

    def __post_init__(self) -> None:
        try:
            fmt = check_format(self.format, component=True)
        except ValueError:
            raise ValueError(
                f"unknown component format {self.format!r}; expected one of {format_names()}"
            ) from None
        object.__setattr__(self, "format", fmt)
        for what in ("path", "tracker"):
            value = getattr(self, what)
            if value is not None:
                _check_relative(value, what, file=not self.owns_directory and what == "path")

    def resolve(self, name: str, step: int, rank: int = 0, world_size: int = 1) -> str:
        """The component's path inside the step directory for ``step`` (and ``rank``); by
        default its name (a group's member ``policy.model``: ``policy/model``)."""
        return _expand(self.path or name.replace(".", "/"), step, rank, world_size)

    def resolve_tracker(self, step: int) -> str | None:
        return None if self.tracker is None else _expand(self.tracker, step, 0, 1)

    @property
    def owns_directory(self) -> bool:
        """A directory at its path (dcp, torch_dist, megatron_legacy), not one file (pt)."""
        return get_format(self.format).owns_directory

    @property
    def per_rank(self) -> bool:
        """A ``pt`` file every rank writes (its path names the rank)."""
        return not self.owns_directory and "{rank" in (self.path or "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _expand(template: str, step: int, rank: int, world_size: int) -> str:
    return template.format(step=step, rank=rank, world_size=world_size)


def _check_relative(value: Any, what: str, *, file: bool) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"component {what} must be a non-empty string, not {value!r}")
    try:
        expanded = _expand(value, 0, 0, 1)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"component {what} {value!r}: only {{step}}, {{rank}} and {{world_size}} may be "
            f"used ({e!r})"
        ) from None
    if "{rank" in value and not file:
        raise ValueError(
            f"component {what} {value!r}: only a pt file's path may name the rank (the other "
            "formats write every rank's shards into one directory)"
        )
    parts = expanded.split("/")
    if (
        expanded.startswith("/")
        or "\\" in expanded
        or any(p in ("", ".", "..") for p in parts)
        or any(_layout.is_leftover(p) for p in parts)
        or parts[0] == _layout.MANIFEST
    ):
        raise ValueError(
            f"component {what} {value!r} must be a plain relative path inside the step "
            "directory (no '..', no leading '/', no empty parts, no '.tmp-'/'.trash-' names)"
        )


def check_spec(spec: Any) -> dict[str, Component]:
    """``components=`` as given, checked and flattened: names -> ``Component`` (or a format
    name), or a group of them (``{"policy": {"model": ..., "optimizer": ...}}``: members are
    named ``"policy.model"``). Names are non-empty strings without '/' or '.'; paths are
    distinct and none lies inside another component's directory. Raises ``ValueError`` /
    ``TypeError`` naming the problem."""
    if not isinstance(spec, Mapping) or not spec:
        raise TypeError(
            "components must be a non-empty dict of name -> Component(...) or format name, "
            f"not {spec!r}"
        )
    out: dict[str, Component] = {}

    def add(name: Any, c: Any, group: str | None) -> None:
        if not isinstance(name, str) or not name or "/" in name or "." in name:
            raise ValueError(
                f"component name {name!r} must be a non-empty string without '/' or '.'"
            )
        full = name if group is None else f"{group}.{name}"
        if isinstance(c, Mapping) and group is None and c:
            for member, mc in c.items():
                add(member, mc, name)
            return
        if isinstance(c, str):
            c = Component(c)
        if not isinstance(c, Component):
            raise TypeError(
                f"component {full!r} must be a Component, a format name or (one level) a "
                f"dict of them, not {c!r}"
            )
        out[full] = c

    for name, c in spec.items():
        add(name, c, None)
    # Where each one lands (step 0, rank 0 stand for any): two in one place, or one inside a
    # directory another format owns, would overwrite each other's files.
    candidates: list[tuple[str, str | None, Component | None]]
    candidates = [(f"component {n!r}", c.resolve(n, 0), c) for n, c in out.items()]
    candidates += [(f"tracker of {n!r}", c.resolve_tracker(0), None) for n, c in out.items()]
    places = [(who, where, c) for who, where, c in candidates if where is not None]
    seen: dict[str, str] = {}
    for who, where, _ in places:
        if where in seen:
            raise ValueError(f"{seen[where]} and {who} are both at {where!r}")
        seen[where] = who
    for who, where, _ in places:
        for other, there, owner in places:
            if owner is not None and owner.owns_directory and where.startswith(there + "/"):
                fmt = owner.format
                raise ValueError(
                    f"{who} at {where!r} lies inside {other}'s directory {there!r} ({fmt})"
                )
    return out


def expand_groups(spec: Mapping[str, Component], state: Any) -> Any:
    """The state with each group's dict opened into its members (``state["policy"]["model"]``
    becomes ``"policy.model"``); the objects themselves are not copied (loads are in place)."""
    if not isinstance(state, Mapping):
        return state
    out: dict[str, Any] = {}
    for key, value in state.items():
        members = [n for n in spec if n.startswith(f"{key}.")]
        if key in spec or not members:
            out[key] = value
            continue
        if not isinstance(value, Mapping):
            raise TypeError(
                f"state entry {key!r} must be a dict of its components "
                f"({', '.join(m.split('.', 1)[1] for m in members)}), not {type(value).__name__}"
            )
        out.update({f"{key}.{sub}": v for sub, v in value.items()})
    return out


def check_state_names(spec: Mapping[str, Component], state: Any, *, saving: bool) -> None:
    """The state's top-level keys against the components: a save needs every one of them
    (a step is committed whole); a load may ask for some (an evaluation: the policy only)."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"with components, the state must be a dict of component name -> state "
            f"({', '.join(spec)}), not {type(state).__name__}"
        )
    unknown = [k for k in state if k not in spec]
    if unknown:
        raise ValueError(
            f"state entries {unknown} are not components of this engine; its components are "
            f"{list(spec)}"
        )
    missing = [k for k in spec if k not in state]
    if saving and missing:
        raise ValueError(
            f"the state lacks component(s) {missing}: a step is saved and committed whole "
            f"(components: {list(spec)})"
        )


def prefix(name: str) -> str:
    """The prefix of a component's keys (staging, objects, manifest paths) in the job."""
    return f"{name}/"


def strip(mapping: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The entries of ``mapping`` that belong to component ``name``, without its prefix."""
    p = prefix(name)
    return {k[len(p) :]: v for k, v in mapping.items() if k.startswith(p)}


# ------------------------------------------------------------------------------ trainer side


def prepare(spec: Mapping[str, Component], state: Any, *, rank: int, legacy: Any = None) -> Any:
    """Every component's part prepared in its format, keys prefixed by the component name."""
    state = expand_groups(spec, state)
    check_state_names(spec, state, saving=True)
    tensors: dict = {}
    objects: dict = {}
    paths: dict = {}
    parts = []
    for name, c in spec.items():
        # A one-file part is rank 0's (or every rank's, when its path names the rank); a
        # directory format decides itself (megatron_legacy: LegacyRanks.write).
        writes = c.owns_directory or rank == 0 or c.per_rank
        options = SaveOptions(
            legacy=legacy or LegacyRanks(), writes=writes, what=f"component {name!r}"
        )
        try:
            part = prepare_part(get_format(c.format), state[name], options)
        except NotSerializable as e:
            key = f"{name}.{e.key}" if e.key else name
            raise NotSerializable(f"component {name!r}: {e}", key, e.type_name) from e
        except (TypeError, ValueError) as e:
            raise type(e)(f"component {name!r}: {e}") from e
        p = prefix(name)
        tensors.update({p + k: v for k, v in part.tensors.items()})
        objects.update({p + k: v for k, v in part.objects.items()})
        paths.update({p + k: v for k, v in part.paths.items()})
        parts.append((name, c, part.extra))
    spec_json = {n: c.to_json() for n, c in spec.items()}
    return Prepared(
        tensors, objects, paths, {"components": parts, "manifest": {"components": spec_json}}
    )


# ------------------------------------------------------------------------------ worker side


def write(
    extra: Mapping[str, Any],
    views: Mapping[str, Any],
    objects: Mapping[str, bytes],
    directory: Path,
    *,
    step: int,
    world_size: int,
    options: Any,
    paths: Mapping[str, list] | None = None,
) -> dict[str, tuple[int, int]]:
    """Write every component into its place under ``directory``; crcs by relative path.

    Components are written in the order they were declared, the same on every rank, so the
    collective formats (dcp, torch_dist) meet their peers. ``options``: the worker's
    ``base.WriteOptions``; ``paths``: the prepared paths, prefixed by component.
    """
    rank = options.rank
    crcs: dict[str, tuple[int, int]] = {}
    for name, c, part_extra in extra["components"]:
        rel = c.resolve(name, step, rank, world_size)
        target = directory / rel
        fmt = format_of(c.format, part_extra)
        if fmt.owns_directory:
            target.mkdir(parents=True, exist_ok=True)
        cache = f"{options.plan_cache}/{name}" if options.plan_cache else None
        part = Prepared(
            strip(views, name), strip(objects, name), strip(paths or {}, name), part_extra
        )
        written = fmt.write(part, target, dataclasses.replace(options, plan_cache=cache))
        # A directory's files are named from it, a one-file part's from its directory.
        base = rel if fmt.owns_directory else posixpath.dirname(rel)
        crcs.update({posixpath.join(base, k): v for k, v in written.items()})
        tracker = c.resolve_tracker(step)
        if tracker is not None and rank == 0:
            (directory / tracker).parent.mkdir(parents=True, exist_ok=True)
            data = f"{step}\n".encode()
            write_synced(directory / tracker, data)
            crcs[tracker] = (checksum(data), len(data))
    return crcs


# ------------------------------------------------------------------------------ loading


@dataclass
class Part:
    """What one load reads: the target, the format, where (a directory, or a pt file)."""

    name: str | None  # the component, or None for a checkpoint of one format
    fmt: str
    state: Any
    location: Path
    paths: dict[str, list] | None
    weights_only: bool = True

    def key(self, k: str) -> str:
        """A key of this part as the load report names it."""
        return k if self.name is None else prefix(self.name) + k


def saved_spec(manifest: Mapping[str, Any] | None, fallback: Mapping[str, Component]) -> dict:
    """The components a checkpoint was written with (its manifest), else the engine's own."""
    recorded = (manifest or {}).get("components")
    if not recorded:
        return dict(fallback)
    return {n: Component(**c) for n, c in recorded.items()}


def load_parts(
    spec: Mapping[str, Component],
    manifest: Mapping[str, Any] | None,
    state: Any,
    directory: Path,
    step: int | None,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> list[Part]:
    """One ``Part`` per component the target asks for, located in ``directory``."""
    state = expand_groups(spec, state)
    check_state_names(spec, state, saving=False)
    saved = saved_spec(manifest, spec)
    if step is None:
        step = int((manifest or {}).get("step", -1))
    absent = [n for n in state if n not in saved]
    if absent:
        raise StateMismatch(
            f"{directory} has no component(s) {absent} (it holds {list(saved)}); nothing was loaded"
        )
    paths = (manifest or {}).get("paths") or {}
    parts = []
    for name in state:
        c = saved[name]
        if c.format != spec[name].format:
            raise StateMismatch(
                f"component {name!r} of {directory} is in format {c.format!r}, but this "
                f"engine declares {spec[name].format!r}; nothing was loaded"
            )
        location = directory / c.resolve(name, step, rank, world_size)
        parts.append(
            Part(name, c.format, state[name], location, strip(paths, name) or None, c.weights_only)
        )
    return parts
