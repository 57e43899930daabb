"""DCP's save planning for the worker's flat states: leaves serialised by the trainer written
as they are, local plans reused under a key that covers the whole layout (across ranks, every
rank's), and the object paths ``.metadata`` records.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from asyncckpt._torch import dcp_plan_cache, dcp_plan_caches
from asyncckpt.cluster import dist as _dist
from asyncckpt.core.cachekeys import DcpPlanKeys, dcp_plan_signature, signature_digest


class Serialized(bytes):
    """A leaf already serialised with ``torch.save`` by the trainer; written as is."""


#: DCP's plan-cache key per name written again and again (``cachekeys`` says what it covers).
_PLAN_KEYS = DcpPlanKeys()


class _PassThroughPlanner(DefaultSavePlanner):
    """DCP's default planner for the worker's flat states: pre-serialised leaves are written
    as they are, and with plan caching the *local* plan is reused too.

    DCP's plan caching skips the global planning when the local plan is unchanged, but builds
    the local plan every time to find out (~20 us a tensor, 0.4 s at 20,000). ``write_flat``
    turns caching on only under a key that covers the state's whole layout
    (``cachekeys.dcp_plan_signature``), so a plan cached under the key is this state's local
    plan, and it is taken instead, as DCP does when its comparison succeeds.
    """

    _reuse: SavePlan | None = None
    #: Each flat key's object path in the nested state (``object_paths``), written as
    #: ``.metadata``'s ``planner_data`` where the planner flattens (DCP's default planner maps
    #: a key to its path; flattening a flat state would map each key to itself, and DCP's
    #: tools, ``dcp_to_torch_save``, would give back flat keys).
    object_paths: Mapping[str, tuple] | None = None
    #: Node-local storage (``node_commit.py``): a tensor every rank holds alike is written by
    #: rank 0, whose files every node's root gets; DCP's default spreads them over the ranks,
    #: so another node's directory would lack some. Set once per worker process.
    replicated_on_rank0: bool = False

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        if _PassThroughPlanner.replicated_on_rank0:  # (DefaultSavePlanner's own option)
            self.dedup_save_to_lowest_rank = True
        key = self._cached_plans_key
        # What DCP's caching needs from the last save: every rank its own local and final
        # plans, the coordinator also every rank's plans and the metadata.
        names = ["_cached_save_plan", "_cached_final_save_plan"]
        if is_coordinator:
            names += ["_cached_all_plans", "_cached_metadata"]
        caches = [dcp_plan_cache(n) for n in names]
        cached = self._enable_plan_caching and all(key in cache for cache in caches)
        if not cached:
            self._reuse = None
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            if self.flatten_state_dict and self.object_paths:
                paths = self.object_paths
                self.mappings = {k: paths.get(k, p) for k, p in self.mappings.items()}
            return
        # A flat state flattens to itself: the traversal is skipped with the planning (the
        # plan's planner_data is the mapping: the cache key covers the object paths).
        self._reuse = dcp_plan_cache("_cached_save_plan")[key]
        self.mappings = self._reuse.planner_data
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        if self._reuse is None:
            return super().create_local_plan()
        self.plan = self._reuse
        return SavePlan([], usable=False)  # DCP's own answer for an unchanged local plan

    def transform_object(self, write_item: Any, object: Any) -> Any:
        if isinstance(object, Serialized):
            return io.BytesIO(object)
        return super().transform_object(write_item, object)


#: This process, as other ranks' workers know it (a pid can be reused; this cannot).
_PROCESS_ID = uuid.uuid4().hex


def _all_layouts(process_group: Any, signature: tuple | None) -> str | None:
    """One digest of every rank's (``_PROCESS_ID``, digest of its plan signature), the same
    on every rank; None if any rank's signature is None. Rank 0 gathers and broadcasts it
    (O(N) in all; an all-gather handed every rank all N ranks' digests)."""
    rank = dist.get_rank(process_group)
    mine = (_PROCESS_ID, None if signature is None else signature_digest(signature))
    ranks = _dist.gather(process_group, mine, dist.get_world_size(process_group), rank)
    combined = None
    if ranks is not None and all(d is not None for _, d in ranks):
        combined = signature_digest(tuple(ranks))
    return _dist.broadcast(process_group, combined)


def cache_plans(
    planner: Any,
    flat: Mapping[str, Any],
    plan_cache: str,
    object_paths: Mapping[str, tuple] | None,
    process_group: Any,
) -> None:
    """Turn DCP's plan caching on for ``planner`` under a key that covers ``flat``'s whole
    layout (``write_flat``'s ``plan_cache``: the name of what is written again and again)."""
    if not hasattr(planner, "_enable_plan_caching"):
        return
    # DCP's own check of an unchanged local plan ignores dtypes, so its cache is only
    # turned on under a key that covers the whole layout (``cachekeys``). Across ranks the
    # key covers every rank's layout and process: the coordinator plans afresh only when
    # its own key is new, so any rank's change must change the key everywhere; and DCP's
    # caching assumes the coordinator holds the plans every other rank skips sending,
    # which a restarted worker (its caches empty) would break.
    signature = dcp_plan_signature(flat, Serialized, object_paths)
    layout: Any = signature
    if process_group is not None:
        ranks = _all_layouts(process_group, signature)
        layout = None if ranks is None else (signature, ranks)
    if layout is not None:  # the same on every rank: a rank's None disables it everywhere
        name = f"asyncckpt:{type(planner).__name__}:{plan_cache}"
        planner._enable_plan_caching = True
        planner._cached_plans_key = _PLAN_KEYS.key(name, layout, dcp_plan_caches())


#: The last ``dcp_object_paths`` answer: a worker gets the same paths object save after save.
_last_object_paths: tuple[Any, dict[str, tuple]] = (None, {})


def dcp_object_paths(paths: Mapping[str, list] | None) -> dict[str, tuple]:
    """DCP's object path of each key (``.metadata``'s ``planner_data``), from the typed paths
    of ``core.tree.flatten_state``: dict keys as ``str`` (DCP's ``traverse_state_dict`` makes
    them so), list indices as ``int``."""
    global _last_object_paths
    if not paths:
        return {}
    last, out = _last_object_paths
    if paths is last:
        return out
    out = {k: tuple(i if kind == "l" else str(i) for kind, i in p) for k, p in paths.items()}
    _last_object_paths = (paths, out)
    return out
