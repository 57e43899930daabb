"""Where an engine's checkpoints live: its local root, its remote tier, and for a URL root
the local spool the saves are committed in first."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from asyncckpt.core.paths import check_local_root, is_url
from asyncckpt.options import EngineOptions
from asyncckpt.retention import KeepLast, RetentionPolicy
from asyncckpt.storage import RemoteTier


def resolve_root(
    root: str | os.PathLike, opts: EngineOptions
) -> tuple[Path, RemoteTier | None, RetentionPolicy | None]:
    """(local root, remote tier, local retention) of an engine.

    A path: that root, ``opts.remote`` as its tier (if any) and ``opts.keep`` on disk. A URL
    (``s3://bucket/run``): the store is where checkpoints live, with ``opts.keep``; they are
    written and committed first in a local spool directory, which keeps only the newest (a
    warm copy for a fast resume on the same machine).
    """
    store = opts.object_store
    if isinstance(root, str) and is_url(root):
        if opts.remote is not None:
            raise ValueError(
                f"{root} is already the remote tier; pass remote= only with a local root"
            )
        tier = RemoteTier(
            root,
            keep=opts.keep,
            storage_options=dict(store.storage_options or {}),
            max_queued_uploads=store.max_queued_uploads,
        )
        spool = Path(store.spool) if store.spool is not None else default_spool(tier)
        return check_local_root(spool), tier, KeepLast(1)
    if store.storage_options is not None or store.spool is not None:
        raise ValueError(
            "object_store= (storage_options, spool) is for a URL root (s3://...); for a local "
            "root with an object-store copy pass remote=RemoteTier(url, storage_options=...)"
        )
    if opts.remote is not None and not isinstance(opts.remote, RemoteTier):
        raise TypeError(f"remote must be a RemoteTier, not {opts.remote!r}")
    return check_local_root(root), opts.remote, opts.keep


def default_spool(tier: RemoteTier) -> Path:
    """``$ASYNCCKPT_SPOOL`` (or the temp dir)/asyncckpt-spool/<scheme>/<bucket>/<path>-<key>.

    ``key`` hashes everything that identifies the store (``RemoteTier.identity``: protocol,
    endpoint, bucket, prefix): two stores with the same bucket and prefix at two endpoints (a
    staging and a production S3, two test servers) never share a spool."""
    base = Path(
        os.environ.get("ASYNCCKPT_SPOOL") or Path(tempfile.gettempdir()) / "asyncckpt-spool"
    )
    scheme, rest = tier.url.split("://", 1)
    parts = [p for p in rest.split("/") if p not in ("", ".", "..")] or ["root"]
    return base.joinpath(scheme, *parts[:-1], f"{parts[-1]}-{tier.spool_key()}")
