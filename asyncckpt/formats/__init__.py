"""On-disk formats: how a flat state becomes files in a directory, and back.

``dcp`` is plain torch.distributed.checkpoint. ``torch_dist`` (Megatron dist_checkpointing)
and ``megatron_legacy`` (``--ckpt-format torch``) build on it; ``pt`` is one ``torch.save``
file (a component's format only). Each is a ``Format`` (``base.py``), looked up by name in a
registry that a user's own format joins with ``register_format``; the built-in ones are
imported on first use, so ``import asyncckpt`` stays free of torch.

The formats:

- ``dcp``: plain DCP (a package: planner, writer, reader, metadata cache).
- ``torch_dist``: Megatron's ``torch_dist``: ``metadata.json``, ``common.pt``, DCP shards.
- ``megatron_legacy``: Megatron-LM's legacy per-rank ``torch.save`` files.
- ``pt``: one ``torch.save`` file, a component's format.
- ``components``: several formats in one checkpoint, committed together.

What they share:

- ``base``: the ``Format`` protocol, what the engine asks of a format and hands over.
- ``staged``: the bridge to staging: what the trainer stages, what the worker writes.
- ``records``: DCP's per-tensor ``torch.save`` records, written from templates, read in place.
- ``differential``: the worker's half of differential saves: unchanged files hard-linked.
- ``wholefiles``: a checkpoint's files read once, whole, checked as they are read.
- ``precheck``: before a load reads into its target, every file against the manifest.
- ``loadcheck``: before a load writes anything, whether the target fits the checkpoint.
- ``hotread``: a DCP read whose tensor bytes come from a surviving worker's memory.
- ``reading``: a whole checkpoint read back as a new nested dict, without a target.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from asyncckpt.formats.base import Format, Prepared, SaveOptions

#: The built-in formats a checkpoint (``format=``) can have; a registered format that owns a
#: directory can be one too (``check_format``). A plain tuple, not a view of the registry.
FORMATS = ("dcp", "torch_dist", "megatron_legacy")
#: Other spellings accepted for a format ("torch" is Megatron-LM's ``--ckpt-format torch``);
#: ``register_format(..., aliases=)`` adds to it.
FORMAT_ALIASES = {"torch": "megatron_legacy", "legacy": "megatron_legacy"}

#: name -> the format, or for a built-in not used yet "module:class" in this package.
_REGISTRY: dict[str, Format | str] = {
    "dcp": "dcp:DCPFormat",
    "torch_dist": "torch_dist:TorchDistFormat",
    "megatron_legacy": "megatron_legacy:MegatronLegacyFormat",
    "pt": "pt:PtFormat",
}
BUILTIN_FORMATS = tuple(_REGISTRY)


def default_format(layout: str) -> str:
    return "torch_dist" if layout == "megatron" else "dcp"


def format_names() -> tuple[str, ...]:
    """Every registered format's name, built-in ones first."""
    return tuple(_REGISTRY)


def register_format(fmt: Format, *, aliases: Iterable[str] = ()) -> None:
    """Make ``fmt`` usable by name: ``format=fmt.name`` (a format that owns a directory) or
    ``Component(fmt.name)``. Refuses a name or alias already taken."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register_format takes a Format instance, not {fmt!r}")
    name = getattr(fmt, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"format {fmt!r} needs a non-empty string name")
    aliases = tuple(aliases)
    taken = [n for n in (name, *aliases) if n in _REGISTRY or n in FORMAT_ALIASES]
    if taken or len(set(aliases) | {name}) != len(aliases) + 1:
        raise ValueError(
            f"format name {name!r} or alias already taken ({taken or 'repeated'}); registered: "
            f"{format_names()}, aliases: {sorted(FORMAT_ALIASES)}"
        )
    _REGISTRY[name] = fmt
    FORMAT_ALIASES.update(dict.fromkeys(aliases, name))


def unregister_format(name: str) -> None:
    """Forget a registered format and its aliases (built-in ones stay)."""
    if name in BUILTIN_FORMATS:
        raise ValueError(f"format {name!r} is built in")
    if _REGISTRY.pop(name, None) is None:
        raise ValueError(f"format {name!r} is not registered")
    for alias in [a for a, n in FORMAT_ALIASES.items() if n == name]:
        del FORMAT_ALIASES[alias]


def get_format(name: str) -> Format:
    """The registered format of that name or alias; ``ValueError`` naming the registered
    ones if there is none."""
    canonical = FORMAT_ALIASES.get(name, name)
    fmt = _REGISTRY.get(canonical) if isinstance(canonical, str) else None
    if fmt is None:
        raise ValueError(f"unknown format {name!r}; expected one of {format_names()}")
    if isinstance(fmt, str):  # a built-in, imported on first use
        module, cls = fmt.split(":")
        fmt = _REGISTRY[canonical] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return fmt


def check_format(name: str, *, component: bool = False) -> str:
    """The canonical name of the format a checkpoint (or with ``component``, a component) is
    written in; ``ValueError`` listing the possible ones otherwise. A checkpoint's format
    must own a directory (``pt``, one file, is a component's only)."""
    try:
        fmt = get_format(name)
        if component or fmt.owns_directory:
            return fmt.name
    except ValueError:
        pass
    possible = tuple(n for n in _REGISTRY if component or get_format(n).owns_directory)
    raise ValueError(f"unknown format {name!r}; expected one of {possible}")


# ------------------------------------------------- a format on its way to the worker and back

#: Where a registered (not built-in) format rides along in ``Prepared.extra`` to the worker.
FORMAT_KEY = "asyncckpt.format"
#: Modules the worker (a spawned process that never runs the trainer's script) cannot import.
_UNIMPORTABLE_IN_WORKER = ("__main__", "__mp_main__")


def prepare_part(fmt: Format, state: Any, options: SaveOptions) -> Prepared:
    """``fmt.prepare``, with a format that is not built in attached for the worker."""
    prepared = fmt.prepare(state, options)
    if fmt.name not in BUILTIN_FORMATS:
        cls = type(fmt)
        if cls.__module__ in _UNIMPORTABLE_IN_WORKER:
            raise TypeError(
                f"format {fmt.name!r} is {cls.__module__}.{cls.__qualname__}, defined in the "
                "trainer's __main__: the worker (a spawned process that does not run the "
                "trainer's script) could not unpickle it; define it in an importable module"
            )
        prepared.extra = {**prepared.extra, FORMAT_KEY: fmt}
    return prepared


def format_of(fmt: str | Format, extra: Mapping[str, Any] | None) -> Format:
    """The format to write with: given as one, carried by the job, else registered here."""
    if isinstance(fmt, Format):
        return fmt
    carried = (extra or {}).get(FORMAT_KEY)
    return carried if carried is not None else get_format(fmt)
