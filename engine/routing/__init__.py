"""Request placement over a cluster of hybrid-KV workers: pure policy, no I/O, no torch, no ray.

- ``index``: the global prefix index fed by workers' KV events (per key its few holders, no
  per-worker mask); predicts the hit of every holder of a prompt's blocks with the coordinator's
  own hybrid rules (full prefix, sliding-window tail, Mamba state, LCM alignment), and applies
  their events and snapshots.
- ``hit_rules``: those rules over any per-group hash sets (``HitRules``), and ``WorkerSnapshot``.
- ``placement_policy``: ``PlacementPolicy``, the interface every policy offers.
- ``factory``: ``build_router`` builds the policy a ``RouterConfig`` names.
- ``policy``: ``RoutingPolicy`` (kvfleet): placement cost, imbalance guard, P/D choice, pins.
- ``load``: time-averaged queue lengths for the sustained-imbalance guard.
- ``pins``: cluster-wide pinned prefixes (replicas, TTL, capacity, re-establishment, auto mode) and
  their holders' life cycle; the hot-prefix counting of auto mode is in ``hot_prefixes``.
- ``baselines``: round robin, least loaded, approximate prefix tree (for comparison).
- ``types``: requests, loads, decisions and the actions the caller executes.
- ``outcomes``: route decisions counted per reason as hit / miss / below the best worker's hit.
"""

from engine.routing.baselines import (
    LeastLoadedPolicy,
    PrefixTreePolicy,
    RoundRobinPolicy,
)
from engine.routing.factory import build_router
from engine.routing.index import (
    HitRules,
    PrefixIndex,
    WorkerSnapshot,
    snapshot_coordinator,
)
from engine.routing.outcomes import RouteOutcomes
from engine.routing.placement_policy import POLICIES, PlacementPolicy
from engine.routing.policy import RoutingPolicy
from engine.routing.types import (
    Action,
    Decision,
    NoWorkerError,
    PinCapacityError,
    PinInfo,
    PinOn,
    RequestSnapshot,
    RouteRequest,
    Unpin,
    WorkerLoad,
)

__all__ = [
    "POLICIES",
    "Action",
    "Decision",
    "HitRules",
    "LeastLoadedPolicy",
    "NoWorkerError",
    "PinCapacityError",
    "PinInfo",
    "PinOn",
    "PlacementPolicy",
    "PrefixIndex",
    "PrefixTreePolicy",
    "RequestSnapshot",
    "RoundRobinPolicy",
    "RouteOutcomes",
    "RouteRequest",
    "RoutingPolicy",
    "Unpin",
    "WorkerLoad",
    "WorkerSnapshot",
    "build_router",
    "snapshot_coordinator",
]
