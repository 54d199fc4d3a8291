"""The KV tiers in ``Cluster.stats()`` (and so ``/v1/stats`` and ``/metrics``): per worker and
over the cluster, prompt tokens served from each tier and the host tier's occupancy, block
moves, bytes and copy seconds (``kv_cache.offload``; docs/architecture.md, "The hybrid KV
cache": the host tier).

Owns the one rule for a worker's hits per tier: without a host tier every hit is a device hit;
with one, the split is the engine's ``host_tier["hit_tokens"]`` (absent from engines that do not
count it: then the split is unknown, None, never guessed). Every value is plain data.
"""

from __future__ import annotations

from typing import Any

TIERS = ("device", "host")
#: ``TierCounters`` fields of ``WorkerView.host_tier_stats()``: blocks offloaded to the host,
#: refreshed there (already held), dropped (no free host block), promoted back to the device
BLOCK_MOVES = ("offloaded", "refreshed", "dropped", "promoted")
#: byte and second counters of the host tier, summed as they are
COPY_COUNTERS = (
    "bytes_offloaded",
    "bytes_promoted",
    "offload_seconds",
    "promote_seconds",
    "copy_seconds",
    "host_bytes",
    "memcpy_bytes",  # the promotes' same-process reference copies (kv_cache.offload.measure_memcpy)
    "memcpy_seconds",
)


def hit_tokens_by_tier(stats: dict[str, Any]) -> dict[str, int] | None:
    """A worker's prompt tokens served from each tier (``{"device": n, "host": n}``) from its
    engine's stats; None when it has a host tier whose engine does not split its hits."""
    host = stats.get("host_tier")
    if host is None:
        return {"device": int(stats["hit_tokens"]), "host": 0}
    split = host.get("hit_tokens")
    if not isinstance(split, dict):
        return None
    return {tier: int(split.get(tier, 0)) for tier in TIERS}


def host_tier_summary(stats: dict[str, Any]) -> dict[str, Any] | None:
    """A worker's host tier (None when off): per pool and in all its usable and cached blocks
    (``occupancy``: cached over usable), the block moves, the bytes copied each way, the
    host-side copy seconds (each way and in all) and the host memory it holds."""
    host = stats.get("host_tier")
    if host is None:
        return None
    pools = [{"num_blocks": int(p["num_blocks"]), "cached_blocks": int(p["cached_blocks"])} for p in host["pools"]]
    out: dict[str, Any] = {"pools": pools, **_occupancy(pools)}
    out.update({f"{move}_blocks": int(host.get(move, 0)) for move in BLOCK_MOVES})
    out.update({key: host.get(key, 0) for key in COPY_COUNTERS})
    return out


def host_tier_totals(workers: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The host tiers of every worker summed (None when no worker has one); ``occupancy`` over
    every pool of every worker."""
    tiers = [w["host_tier"] for w in workers.values() if w.get("host_tier") is not None]
    if not tiers:
        return None
    keys = [f"{move}_blocks" for move in BLOCK_MOVES] + list(COPY_COUNTERS)
    totals: dict[str, Any] = {"workers": len(tiers)}
    totals.update(_occupancy([pool for tier in tiers for pool in tier["pools"]]))
    totals.update({key: sum(tier[key] for tier in tiers) for key in keys})
    return totals


def hit_tokens_by_tier_totals(workers: dict[str, dict[str, Any]]) -> dict[str, int] | None:
    """Hit tokens per tier over every worker; None when some worker's split is unknown."""
    splits = [w.get("hit_tokens_by_tier") for w in workers.values()]
    if any(split is None for split in splits):
        return None
    return {tier: sum(split[tier] for split in splits if split is not None) for tier in TIERS}


def _occupancy(pools: list[dict[str, int]]) -> dict[str, Any]:
    usable = sum(p["num_blocks"] for p in pools)
    cached = sum(p["cached_blocks"] for p in pools)
    return {"num_blocks": usable, "cached_blocks": cached, "occupancy": cached / usable if usable else 0.0}
