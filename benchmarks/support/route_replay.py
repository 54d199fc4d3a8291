"""How much token hit rate placement alone can win on a workload.

The cluster benchmark compares routers on a real cluster, where concurrency, timing and CPU
contention move every number. This replays the same prompts with none of that: one request at
a time, through ``num_workers`` real ``HybridCoordinator``s built like the workers' (the
config's KV groups, pool size and retention tier), each request prefilled in
``scheduler.prefill_chunk_size`` chunks cut as the scheduler cuts them (align mode for Mamba
groups, ending a chunk at the attention-only hit: ``engine.scheduler.recurrent_checkpoint``;
windows dropped after each chunk), decoded for ``max_tokens`` steps, then freed. Placement by:

* ``prefix_tree``: the approximate tree the benchmark runs (``PrefixTreePolicy``), fed with its
  own routing history only, and with each worker's requests served so far (less the fewest) as
  its running count: the tree balances new prefixes by running requests, which on a live
  cluster tracks what each worker was given (idle loads would tie every time and pile new
  prefixes on one worker at random, a handicap the live tree does not have);
* ``kvfleet``: kvfleet's policy (``RoutingPolicy``), fed with the coordinators' KV events;
* ``exact_oracle``: the worker whose coordinator holds the longest hit for this prompt at this
  moment (perfect knowledge; ties to the worker that served the fewest requests);
* ``round_robin``.

Every worker is idle when a request arrives (kvfleet balances new prefixes by the work it
assigned lately, its own average), so only cache knowledge and that balancing steer.
``exact_oracle`` over ``prefix_tree`` is what exact hit knowledge can win here; ``bound`` is
``kvfleet_testing.workloads.hit_rate_bound`` (unbounded cache). Measured for the hybrid workloads in
benchmarks/cluster_bench.py's docstring.
"""

from __future__ import annotations

import logging
from typing import Any

from configs import ClusterConfig
from engine.kv_cache import CacheRequest, HybridCoordinator, RetentionOptions
from engine.kv_cache.spec import MambaSpec, alignment_tokens
from engine.routing.baselines import PrefixTreePolicy, RoundRobinPolicy
from engine.routing.placement_policy import PlacementPolicy
from engine.routing.policy import RoutingPolicy
from engine.routing.types import RouteRequest, WorkerLoad
from engine.scheduler import aligned_chunk, recurrent_checkpoint
from kvfleet_testing.sizing import kv_groups, sized_config, vocab_size
from kvfleet_testing.workloads import hit_rate_bound

log = logging.getLogger(__name__)

PLACEMENTS = ("prefix_tree", "kvfleet", "exact_oracle", "round_robin")
#: the routers' clock advances this much per request (their work averages decay in seconds)
SECONDS_PER_REQUEST = 1.0


class _Workers:
    """``count`` coordinators built like the config's workers, and how many requests each served."""

    def __init__(self, config: ClusterConfig, groups: list[Any], count: int):
        cache = config.kv_cache
        pinning = cache.pinning
        retention = RetentionOptions(
            pinning.enabled, pinning.budget_blocks, pinning.pin_sliding_window, pinning.min_drop_blocks
        )
        self.coords = [
            HybridCoordinator(
                groups, cache.num_blocks, enable_caching=cache.prefix_caching, retention=retention, enable_events=True
            )
            for _ in range(count)
        ]
        self.num_blocks = cache.num_blocks
        self.mamba_align = self.coords[0].alignment if any(isinstance(g.spec, MambaSpec) for g in groups) else 0
        self.served = [0] * count
        self.chunk = config.scheduler.prefill_chunk_size

    def hit(self, k: int, prompt: list[int]) -> int:
        coord = self.coords[k]
        req = CacheRequest("peek", prompt, coord.hash_block_size)
        return coord.find_longest_cache_hit(req.block_hashes, len(prompt) - 1).num_tokens

    def run(self, k: int, prompt: list[int], request_id: str, max_tokens: int) -> int:
        """Admit, prefill, decode and free ``prompt`` on worker ``k``; its hit in tokens."""
        coord = self.coords[k]
        req = CacheRequest(request_id, prompt, coord.hash_block_size)
        coord.new_step()
        hit = coord.get_computed_blocks(req)
        stop = recurrent_checkpoint(coord, req, hit) if self.mamba_align else 0
        done, first = hit.num_tokens, True
        while done < len(prompt):
            step = min(self.chunk, len(prompt) - done)
            if self.mamba_align:  # the scheduler's align-mode chunk, stopping at the checkpoint
                step = aligned_chunk(done, step, len(prompt), self.mamba_align, stop)
            coord.new_step()
            if coord.allocate_slots(req, step, hit if first else None) is None:
                raise RuntimeError(f"{request_id}: {step} tokens do not fit in {self.num_blocks} blocks")
            first = False
            done += step
            req.num_computed_tokens = done
            coord.remove_skipped_blocks(request_id, done)
        for i in range(max_tokens):
            req.append_token_ids([(len(prompt) * 7 + i + 1) % 30000])
            coord.new_step()
            if coord.allocate_slots(req, 1) is None:
                raise RuntimeError(f"{request_id}: decode step {i} does not fit")
            req.num_computed_tokens += 1
            coord.remove_skipped_blocks(request_id, req.num_computed_tokens)
        coord.free(request_id)
        self.served[k] += 1
        return hit.num_tokens


class _RouterPlacement:
    """A router driving ``workers``: it routes each prompt, then (``settle``) its clock advances
    and it hears the workers' KV events (kvfleet) and their loads before the next one."""

    def __init__(self, router: PlacementPolicy, workers: _Workers, feed_events: bool, served_as_running: bool):
        self.router, self.workers = router, workers
        self.feed_events, self.served_as_running = feed_events, served_as_running
        self.names = [f"w{k}" for k in range(len(workers.coords))]
        for name in self.names:
            router.add_worker(name, "both", workers.num_blocks)
        self.block = workers.coords[0].hash_block_size
        self.clock = 0.0

    def place(self, prompt: list[int], request_id: str) -> int:
        hashes = CacheRequest(request_id, prompt, self.block).block_hashes
        decision = self.router.route(RouteRequest(request_id, hashes, len(prompt)), self.clock)
        return self.names.index(decision.prefill_worker)

    def settle(self) -> None:
        self.clock += SECONDS_PER_REQUEST
        served = self.workers.served
        for k, name in enumerate(self.names):
            if self.feed_events:
                self.router.apply_events(name, self.workers.coords[k].take_events(), self.clock)
            running = served[k] - min(served) if self.served_as_running else 0
            self.router.update_load(name, WorkerLoad(running_requests=running))


class _OraclePlacement:
    """Perfect knowledge: the worker whose coordinator holds the longest hit right now (ties to
    the one that served the fewest requests)."""

    def __init__(self, workers: _Workers):
        self.workers = workers

    def place(self, prompt: list[int], request_id: str) -> int:
        workers = self.workers
        hits = [workers.hit(k, prompt) for k in range(len(workers.coords))]
        return max(range(len(hits)), key=lambda k: (hits[k], -workers.served[k], -k))

    def settle(self) -> None:
        pass


class Replay:
    """One workload made ready to replay: its KV groups, the config sized to it and its prompts,
    computed once however many placements replay it."""

    def __init__(self, config: ClusterConfig, workload: Any):
        self.groups = kv_groups(config)
        self.sized = sized_config(config, workload, self.groups)
        self.prompts = workload.prompts(vocab_size(config))
        self.max_tokens = workload.max_tokens

    def run(self, placement: str, num_workers: int) -> dict[str, Any]:
        """One placement over the prompts; token hit rate and requests per worker."""
        if placement not in PLACEMENTS:
            raise ValueError(f"placement: one of {PLACEMENTS} (got {placement!r})")
        workers = _Workers(self.sized, self.groups, num_workers)
        chooser: _RouterPlacement | _OraclePlacement
        if placement == "exact_oracle":
            chooser = _OraclePlacement(workers)
        else:
            if placement == "kvfleet":
                router: PlacementPolicy = RoutingPolicy(self.groups, self.sized.router.model_copy(update={"pins": []}))
            elif placement == "prefix_tree":
                router = PrefixTreePolicy(self.groups)
            else:
                router = RoundRobinPolicy(self.groups)
            chooser = _RouterPlacement(router, workers, placement == "kvfleet", placement == "prefix_tree")
        hit = total = 0
        for i, prompt in enumerate(self.prompts):
            k = chooser.place(prompt, f"r{i}")
            hit += workers.run(k, prompt, f"r{i}", self.max_tokens)
            total += len(prompt)
            chooser.settle()
        return {"hit_rate": round(hit / total, 4) if total else 0.0, "requests_per_worker": workers.served}


def replay(config: ClusterConfig, workload: Any, placement: str, num_workers: int) -> dict[str, Any]:
    """One placement over the workload's prompts; token hit rate and requests per worker."""
    return Replay(config, workload).run(placement, num_workers)


def route_ceiling(config: ClusterConfig, workload: Any, num_workers: int | None = None) -> dict[str, Any]:
    """Every placement on the workload (``num_workers``: the config's prefill workers); the
    hit rates, the unbounded bound and ``oracle_over_prefix_tree``."""
    count = num_workers or config.workers.num_prefill or config.workers.num_decode
    prepared = Replay(config, workload)
    out: dict[str, Any] = {"num_workers": count}
    for placement in PLACEMENTS:
        out[placement] = prepared.run(placement, count)
        log.info("route ceiling %s: %s", placement, out[placement])
    out["bound"] = round(hit_rate_bound(prepared.prompts, alignment_tokens(prepared.groups)), 4)
    tree = out["prefix_tree"]["hit_rate"]
    out["oracle_over_prefix_tree"] = round(out["exact_oracle"]["hit_rate"] / tree, 4) if tree else None
    out["kvfleet_over_prefix_tree"] = round(out["kvfleet"]["hit_rate"] / tree, 4) if tree else None
    return out
