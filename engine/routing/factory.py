"""Build the placement policy a ``RouterConfig`` names (kvfleet's or a baseline).

Lives outside ``engine.routing.router`` so the base class does not import its subclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from configs.schema import RouterConfig
from engine.kv_cache.spec import KVCacheGroup
from engine.routing.baselines import BASELINES
from engine.routing.placement_policy import PlacementPolicy
from engine.routing.policy import RoutingPolicy


def build_router(
    cfg: RouterConfig,
    groups: Sequence[KVCacheGroup],
    tokenize: Callable[[str], list[int]] | None = None,
    now: float = 0.0,
) -> PlacementPolicy:
    """The policy ``cfg.policy`` names, reading ``cfg``'s weights, thresholds and seed; for
    kvfleet's policy the configured pins are placed too.

    ``groups``: the workers' KV-cache groups (all workers of a cluster share them).
    ``tokenize``: needed only for pins given as text.
    """
    if cfg.policy == "kvfleet":
        policy = RoutingPolicy(groups, cfg)
        policy.pin_configured(cfg.pins, tokenize, now)
        return policy
    return BASELINES[cfg.policy](groups, seed=cfg.seed)
