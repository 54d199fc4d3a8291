"""The hit-rate side of ``benchmarks/hybrid_capacity.py``: the shared-prefix sweep through the real
scheduler.

Owns the two coordinators compared at one budget (kvfleet's groups and pools,
``kvfleet_coordinator``; the unified layout's groups in one pool, ``unified_coordinator``), the
scheduler without its recurrent-checkpoint stop (``PlainScheduler``), one run of requests through
``Scheduler`` (``drive``), the shared lengths of the workload (``splits``; its prompts are
``kvfleet_testing.workloads.reuse_prompts``) and the sweep itself (``hit_sweep``, with the config
defaults as ``kvfleet_defaults``: ``DEFAULTS``).
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from benchmarks.support.hybrid_layouts import vllm_group_size
from benchmarks.support.hybrid_models import BLOCK, DTYPE, GIB, count
from configs.schema import KVCacheConfig, SchedulerConfig
from engine.kv_cache import HybridCoordinator, KVCacheGroup
from engine.kv_cache.coordinator import CacheHit
from engine.kv_cache.spec import FullAttentionSpec, MambaSpec
from engine.model.arch.model_arch import RECURRENT_KINDS, ModelArch
from engine.model.kv_budget import split_budget
from engine.model.kv_layout import (
    KVLayout,
    build_kv_layout,
)
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from kvfleet_testing.workloads import reuse_prompts

log = logging.getLogger("hybrid_capacity")
DEFAULTS = KVCacheConfig()  # the config defaults (kvfleet_defaults in the hit sweep)


def kvfleet_coordinator(
    layout: KVLayout, budget: int, max_num_seqs: int, fraction: float, prefix_tokens: int | None
) -> HybridCoordinator:
    split = split_budget(layout, budget, max_num_seqs, fraction, prefix_tokens)
    return HybridCoordinator(layout.groups, split.num_blocks)


def unified_coordinator(arch: ModelArch, block: int, page: int, budget: int) -> HybridCoordinator:
    n_attn = count(arch, ("full_attention", "sliding_attention"))
    n_rec = count(arch, RECURRENT_KINDS)
    g = vllm_group_size([n_attn, n_rec])
    groups = [KVCacheGroup(FullAttentionSpec(block)) for _ in range(-(-n_attn // g))]
    groups += [KVCacheGroup(MambaSpec(block)) for _ in range(-(-n_rec // g))]
    return HybridCoordinator(groups, budget // (page * g))


class PlainScheduler(Scheduler):
    """The scheduler without its recurrent-checkpoint stop (``Scheduler.chunk_stop``, which ends a
    chunk at ``engine.scheduler.recurrent_checkpoint``)."""

    def chunk_stop(self, request: Request, hit: CacheHit) -> int:
        return 0


def drive(
    coord: HybridCoordinator, prompts: list[list[int]], chunk: int, decode: int, boundary: bool
) -> tuple[int, int]:
    """Run requests one at a time through kvfleet's real ``Scheduler`` over ``coord`` (admission
    with its hit, prefill chunks of ``chunk`` tokens cut by its align-mode rule, ``decode`` tokens,
    free); returns (hit tokens, prompt tokens). ``boundary``: the scheduler as it is, which ends a
    chunk where the attention groups alone would hit further than the full hit
    (``Scheduler.chunk_stop``), so the recurrent state there is cached for the next request of the
    prefix; otherwise ``PlainScheduler``."""
    config = SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=1, prefill_chunk_size=chunk)
    scheduler = (Scheduler if boundary else PlainScheduler)(config, coord, max_model_len=1 << 30)
    sampling = SamplingParams(max_tokens=max(1, decode), ignore_eos=True)
    hits = total = 0
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt, sampling, coord.hash_block_size)
        scheduler.add_request(request)
        step = 0
        while scheduler.has_work:
            out = scheduler.schedule()
            if not out.chunks:
                raise RuntimeError(
                    f"request {i} not scheduled at {request.num_computed_tokens} tokens: raise the budget"
                )
            step += 1
            scheduler.update(out, {request.request_id: (i * 7 + step) % 30000})
        hits += request.num_cached_tokens
        total += len(prompt)
    coord.check_invariants()
    return hits, total


def splits(vllm_block: int, count_: int) -> list[int]:
    """Shared lengths: multiples of 16 not multiples of vLLM's block, spread over 0.25..2.75 blocks."""
    out = []
    for k in range(count_):
        s = int(vllm_block * (0.25 + 2.5 * k / max(1, count_ - 1))) // BLOCK * BLOCK
        out.append(s + BLOCK if s % vllm_block == 0 else s)
    return sorted(set(out))


def hit_sweep(arch: ModelArch, cap: dict[str, Any], vllm: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    layout = build_kv_layout(arch, BLOCK, DTYPE)
    block_v = cap["vllm_block_size"]["kvfleet_state"]
    page_v = max(vllm["kvfleet_state"]["page_bytes"], cap["state_bytes"])
    budget = int(args.hit_budget_gib * GIB)
    out: dict[str, Any] = {
        "budget_gib": args.hit_budget_gib,
        "vllm_block_size": block_v,
        "max_num_seqs": args.hit_max_num_seqs,
        "state_cache_fraction": args.hit_state_fraction,
        "kvfleet_defaults": {
            "state_cache_fraction": DEFAULTS.state_cache_fraction,
            "expected_prefix_tokens": DEFAULTS.expected_prefix_tokens,
        },
    }
    chunk_theirs = max(block_v, args.chunk_tokens // block_v * block_v)
    chunk_ours = (
        chunk_theirs if args.kvfleet_chunk_tokens is None else max(BLOCK, args.kvfleet_chunk_tokens // BLOCK * BLOCK)
    )
    out["chunk_tokens"] = {"kvfleet": chunk_ours, "vllm_unified": chunk_theirs}
    for policy in ("boundary", "plain"):
        rows = []
        for shared in splits(block_v, args.splits):
            prompts = reuse_prompts(shared, args.unique_tokens, args.prefixes, args.reuse, args.seed + shared)
            t0 = time.perf_counter()
            hit, total = {}, 0
            for name, coord, chunk in (
                (
                    "kvfleet",
                    kvfleet_coordinator(layout, budget, args.hit_max_num_seqs, args.hit_state_fraction, shared),
                    chunk_ours,
                ),
                (
                    "kvfleet_defaults",
                    kvfleet_coordinator(
                        layout,
                        budget,
                        args.hit_max_num_seqs,
                        DEFAULTS.state_cache_fraction,
                        DEFAULTS.expected_prefix_tokens,
                    ),
                    chunk_ours,
                ),
                ("vllm_unified", unified_coordinator(arch, block_v, page_v, budget), chunk_theirs),
            ):
                hit[name], total = drive(coord, prompts, chunk, args.decode_tokens, policy == "boundary")
            best = shared * args.prefixes * (args.reuse - 1)
            rows.append(
                {
                    "shared_tokens": shared,
                    "inside_vllm_block": shared % block_v != 0,
                    "hit_rate": {**{k: v / total for k, v in hit.items()}, "best": best / total},
                    "hit_tokens": hit,
                    "ratio": hit["kvfleet"] / hit["vllm_unified"] if hit["vllm_unified"] else None,
                }
            )
            log.info(
                "%s: shared %5d: kvfleet %.3f (defaults %.3f) vs unified %.3f (best %.3f) [%.1f s]",
                policy,
                shared,
                *(hit[k] / total for k in ("kvfleet", "kvfleet_defaults", "vllm_unified")),
                best / total,
                time.perf_counter() - t0,
            )
        ours_total = sum(r["hit_tokens"]["kvfleet"] for r in rows)
        theirs_total = sum(r["hit_tokens"]["vllm_unified"] for r in rows)
        out[policy] = {
            "sweep": rows,
            "ratio": ours_total / theirs_total if theirs_total else None,
            "kvfleet_never_lower": all(r["hit_tokens"]["kvfleet"] >= r["hit_tokens"]["vllm_unified"] for r in rows),
            "kvfleet_higher_inside_block": all(
                r["hit_tokens"]["kvfleet"] > r["hit_tokens"]["vllm_unified"] for r in rows if r["inside_vllm_block"]
            ),
            "kvfleet_higher_below_first_block": all(
                r["hit_tokens"]["kvfleet"] > r["hit_tokens"]["vllm_unified"]
                for r in rows
                if r["shared_tokens"] < block_v
            ),
            "points_lower": [
                r["shared_tokens"] for r in rows if r["hit_tokens"]["kvfleet"] < r["hit_tokens"]["vllm_unified"]
            ],
        }
    return out
