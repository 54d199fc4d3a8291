"""Hybrid KV memory: prefix capacity per GiB and token hit rate of kvfleet's pooled layout against
the single padded page it replaced and vLLM 0.33's unified page (issue 13's benchmark).

Models: Bamba-9B, Granite-4.0-H-Small and Nemotron-H-8B, built from Hugging Face config classes
(BambaConfig, GraniteMoeHybridConfig, NemotronHConfig) with the published shapes; no weights.

1. Capacity (bf16 attention KV; recurrent states as kvfleet keeps them: fp32 conv window plus
   SSM state, the same state size for every layout so that only the layout differs), at
   ``--budget-gib`` per worker and ``--max-num-seqs`` running requests:
   * ideal: the budget minus the running requests' states (align mode: 2 per recurrent layer per
     request), all spent on attention KV, no padding, no cached states;
   * padded: today's old layout, one page per block for every group, the largest any layer needs
     (``padded_page_bytes``), groups cut by the smallest bucket;
   * vLLM unified: vLLM's own ``_align_hybrid_block_size`` (run in the anchor venv of
     ../shared/bench/vllm_kv_anchor by benchmarks/vllm_hybrid_block.py) picks the attention block
     that makes one attention page cover a state; groups by vLLM's rule (smallest bucket, or the
     largest if it is < 1.5x the smallest), one pool;
   * kvfleet: ``build_kv_layout`` + ``split_budget`` (config defaults).
   Each layout's cacheable prefix tokens are its attention tokens once the running states are
   reserved; ``capacity_over_ideal`` is kvfleet's over the ideal.
2. Token hit rate: a shared-prefix workload (``--prefixes`` prefixes, each reused ``--reuse``
   times, a unique suffix per request) whose shared length is swept over multiples of 16 that
   are not multiples of vLLM's block, run one request at a time through kvfleet's real
   ``Scheduler`` and ``HybridCoordinator`` twice at the same memory budget: with kvfleet's groups
   and pools, and with the unified layout's groups (block size = vLLM's inflated block, one
   pool). Both run the same prefill chunk, ``--chunk-tokens`` rounded down to a multiple of
   vLLM's block (at least one block: align mode caches a state only at a chunk end on a block
   boundary, and the scheduler cannot end a chunk short of one), then ``--decode-tokens``
   tokens, then free. Two chunk policies, the same for both layouts: ``boundary`` (the headline)
   is the scheduler as it is (``Scheduler.chunk_stop``): when the attention groups alone would
   hit further than the full hit, a chunk ends at that attention hit, so the recurrent state
   there is cached for the next request of the prefix (vLLM 0.33's shared-prefix junction stop
   does the same at its block); ``plain`` (``PlainScheduler``) does not.
   Why the same chunk: a prefix's second request resumes from the first request's last chunk
   end below the shared length, so with shorter chunks than the unified layout's kvfleet can
   resume lower: with ``--kvfleet-chunk-tokens 512`` (kvfleet's default chunk) against vLLM's
   1072, shared 2176 resumes at 2048 vs 2144, and the 32 tokens each later request gains over
   vLLM (2176 vs 2144) do not make up for it with 4 requests per prefix (0.673 vs 0.677).
   kvfleet's budget split in these runs is the workload-adapted one: ``state_cache_fraction``
   ``--hit-state-fraction`` (0.5) with ``expected_prefix_tokens`` = the shared length; the
   config defaults are reported as ``kvfleet_defaults``.
3. ``mamba_decode_speedup``: ``measure_decode`` of benchmarks/mamba_decode.py (Bamba-shaped
   random model, 32 running requests, per-request vs batched Mamba path).
4. ``coordinator_min_speedup``: read from ``--coordinator-json`` (the last line of
   benchmarks/kv_cache_vs_vllm.py) or, with ``--run-coordinator``, by running it
   (``--coordinator-args``).

Measured 2026-11-25 (2-core shared VM, ``--run-coordinator --coordinator-args "--clock cpu --runs
3"``; see benchmarks/README.md): capacity_over_ideal 0.950 / 0.948 / 0.948, capacity_vs_padded
63.3 / 62.7 / 63.1, capacity_vs_vllm_unified 0.961 / 0.953 / 0.950 (Bamba-9B /
Granite-4.0-H-Small / Nemotron-H-8B), mamba_decode_speedup 1.188 (mixers 55% of the step, 1.42x
faster), coordinator_min_speedup {retention_off 2.232, retention_on 1.911}. Hit sweep measured
2026-11-25 through the real scheduler, both layouts at 1072-token chunks: hit_rate_vs_vllm_unified
1.328, kvfleet higher at all eight splits (``plain``: 1.000, equal at every split: without the
chunk stop both cache states only at multiples of 1072); ``kvfleet_defaults`` 0.593 overall, as the
workload-adapted split (0.0 before ``MIN_CACHED_STATES``). With ``--kvfleet-chunk-tokens 512``:
1.433, lower at 2176 (0.673 vs 0.677).

The last stdout line is one JSON object with ``capacity_over_ideal``, ``capacity_vs_padded``,
``capacity_vs_vllm_unified`` (per model), ``hit_rate_vs_vllm_unified`` (kvfleet's total hit
tokens over the unified layout's, over the whole sweep of the first model), ``mamba_decode_speedup``,
``coordinator_min_speedup`` and the details. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.schema import KVCacheConfig, SchedulerConfig
from engine.kv_cache import HybridCoordinator, KVCacheGroup
from engine.kv_cache.coordinator import CacheHit
from engine.kv_cache.spec import FullAttentionSpec, MambaSpec
from engine.model.arch import (
    CACHELESS_KINDS,
    RECURRENT_KINDS,
    ModelArch,
    arch_from_hf_config,
)
from engine.model.kv_budget import STATES_PER_RUNNING_REQUEST, split_budget
from engine.model.kv_layout import (
    KVLayout,
    attention_page_bytes,
    build_kv_layout,
    mamba_page_bytes,
    padded_page_bytes,
)
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

log = logging.getLogger("hybrid_capacity")
GIB = 2**30
BLOCK = 16
DTYPE = "bfloat16"
ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = KVCacheConfig()  # the config defaults (kvfleet_defaults in the hit sweep)

#: published shapes (config.json of each checkpoint); only what the KV layout depends on matters
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bamba-9b": ("BambaConfig", "BambaForCausalLM", dict(  # noqa: C408
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, attn_layer_indices=[9, 18, 27], mamba_n_heads=128,
        mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2)),
    "granite-4.0-h-small": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(  # noqa: C408
        vocab_size=100352, hidden_size=4096, intermediate_size=768, shared_intermediate_size=1536,
        num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, num_local_experts=72,
        num_experts_per_tok=10, mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
        mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=True,
        layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)])),
    "nemotron-h-8b": ("NemotronHConfig", "NemotronHForCausalLM", dict(  # noqa: C408
        vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_hidden_layers=52,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=64,
        n_groups=8, ssm_state_size=128, conv_kernel=4, expand=2)),
}  # fmt: skip


def model_arch(name: str) -> ModelArch:
    import transformers

    config_class, architecture, shape = MODELS[name]
    config = getattr(transformers, config_class)(**shape)
    return arch_from_hf_config({**config.to_dict(), "architectures": [architecture]})


def count(arch: ModelArch, kinds: tuple[str, ...]) -> int:
    return sum(layer.kind in kinds for layer in arch.layers)


def vllm_shape(name: str, arch: ModelArch) -> dict[str, Any]:
    m = arch.mamba
    assert m is not None
    return {"name": name, "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
            "intermediate_size": m.intermediate_size, "n_groups": m.n_groups, "num_heads": m.num_heads,
            "mamba_head_dim": m.head_dim, "d_state": m.d_state, "d_conv": m.d_conv}  # fmt: skip


def ask_vllm(shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's attention block size per model, from its own code in the anchor venv."""
    venv = Path(os.environ.get("VLLM_ANCHOR_VENV", Path.home() / ".cache" / "kvfleet-anchors" / "vllm-venv"))
    python = venv / "bin" / "python"
    if not python.exists():
        anchor = ROOT.parent / "shared" / "bench" / "vllm_kv_anchor" / "install.sh"
        raise SystemExit(f"vLLM anchor venv missing at {venv}: run bash {anchor}")
    out = subprocess.run(
        [str(python), str(ROOT / "benchmarks" / "vllm_hybrid_block.py")],
        input=json.dumps(shapes), capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def vllm_group_size(bucket_sizes: list[int]) -> int:
    """vLLM 0.33's ``_get_kv_cache_groups_uniform_page_size`` rule."""
    smallest, largest = min(bucket_sizes), max(bucket_sizes)
    return largest if largest < smallest * 1.5 else smallest


def one_pool_tokens(budget: int, page: int, group_size: int, attn_groups: int, rec_groups: int,
                    block_tokens: int, max_num_seqs: int) -> int:  # fmt: skip
    """Attention tokens of a one-pool layout once the running requests' states are reserved."""
    blocks = budget // (page * group_size)
    reserved = max_num_seqs * rec_groups * STATES_PER_RUNNING_REQUEST + 1
    return max(0, blocks - reserved) // attn_groups * block_tokens


def capacity(arch: ModelArch, vllm: dict[str, Any], budget: int, max_num_seqs: int) -> dict[str, Any]:
    n_attn = count(arch, ("full_attention", "sliding_attention"))
    n_rec = count(arch, RECURRENT_KINDS)
    token_bytes = attention_page_bytes(arch, 1, DTYPE) * n_attn
    state = mamba_page_bytes(arch)
    running = max_num_seqs * n_rec * STATES_PER_RUNNING_REQUEST * state
    ideal = (budget - running) / token_bytes

    layout = build_kv_layout(arch, BLOCK, DTYPE)
    split = split_budget(layout, budget, max_num_seqs)
    ours = layout.capacity(split.num_blocks)["tokens"]

    g_old = min(n_attn, n_rec)  # the old rule: cut every bucket by the smallest bucket's size
    padded = one_pool_tokens(budget, padded_page_bytes(arch, BLOCK, DTYPE), g_old, -(-n_attn // g_old),
                             -(-n_rec // g_old), BLOCK, max_num_seqs)  # fmt: skip
    g_v = vllm_group_size([n_attn, n_rec])
    block_v = vllm["kvfleet_state"]["block_size"]
    page_v = max(vllm["kvfleet_state"]["page_bytes"], state)
    unified = one_pool_tokens(budget, page_v, g_v, -(-n_attn // g_v), -(-n_rec // g_v), block_v, max_num_seqs)
    return {
        "layers": {"attention": n_attn, "recurrent": n_rec, "cacheless": count(arch, CACHELESS_KINDS)},
        "state_bytes": state,
        "attention_bytes_per_token": token_bytes,
        "ideal_tokens": int(ideal),
        "tokens": {"kvfleet": ours, "padded": padded, "vllm_unified": unified},
        "tokens_per_gib": {"ideal": ideal / (budget / GIB), "kvfleet": ours / (budget / GIB),
                           "padded": padded / (budget / GIB), "vllm_unified": unified / (budget / GIB)},
        "over_ideal": {"kvfleet": ours / ideal, "padded": padded / ideal, "vllm_unified": unified / ideal},
        "kvfleet_pools": [{"kind": p.kind, "page_bytes": p.page_bytes, "slots": p.num_slots, "blocks": n}
                          for p, n in zip(layout.pools, split.num_blocks, strict=True)],
        "kvfleet_cached_states": split.cached_states,
        "vllm_block_size": {"kvfleet_state": block_v, "vllm_state": vllm["vllm_state"]["block_size"]},
        "vllm_group_size": g_v,
        "padded_page_bytes": padded_page_bytes(arch, BLOCK, DTYPE),
    }  # fmt: skip


# -- hit rate ---------------------------------------------------------------------------------------
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
    """The scheduler without its recurrent-checkpoint stop (what it did before issue 13's rule)."""

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
                raise RuntimeError(f"request {i} not scheduled at {request.num_computed_tokens} tokens: raise the budget")
            step += 1
            scheduler.update(out, {request.request_id: (i * 7 + step) % 30000})
        hits += request.num_cached_tokens
        total += len(prompt)
    coord.check_invariants()
    return hits, total


def workload(shared: int, unique: int, prefixes: int, reuse: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(30000) for _ in range(shared)] for _ in range(prefixes)]
    order = [p for _ in range(reuse) for p in range(prefixes)]
    return [heads[p] + [30000 + i] + [rng.randrange(30000) for _ in range(unique - 1)] for i, p in enumerate(order)]


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
    out: dict[str, Any] = {"budget_gib": args.hit_budget_gib, "vllm_block_size": block_v,
                           "max_num_seqs": args.hit_max_num_seqs, "state_cache_fraction": args.hit_state_fraction,
                           "kvfleet_defaults": {"state_cache_fraction": DEFAULTS.state_cache_fraction,
                                                "expected_prefix_tokens": DEFAULTS.expected_prefix_tokens}}
    chunk_theirs = max(block_v, args.chunk_tokens // block_v * block_v)
    chunk_ours = chunk_theirs if args.kvfleet_chunk_tokens is None else max(BLOCK, args.kvfleet_chunk_tokens // BLOCK * BLOCK)
    out["chunk_tokens"] = {"kvfleet": chunk_ours, "vllm_unified": chunk_theirs}
    for policy in ("boundary", "plain"):
        rows = []
        for shared in splits(block_v, args.splits):
            prompts = workload(shared, args.unique_tokens, args.prefixes, args.reuse, args.seed + shared)
            t0 = time.perf_counter()
            hit, total = {}, 0
            for name, coord, chunk in (
                ("kvfleet", kvfleet_coordinator(layout, budget, args.hit_max_num_seqs, args.hit_state_fraction,
                                                shared), chunk_ours),
                ("kvfleet_defaults", kvfleet_coordinator(layout, budget, args.hit_max_num_seqs, DEFAULTS.state_cache_fraction,
                                                         DEFAULTS.expected_prefix_tokens), chunk_ours),
                ("vllm_unified", unified_coordinator(arch, block_v, page_v, budget), chunk_theirs),
            ):  # fmt: skip
                hit[name], total = drive(coord, prompts, chunk, args.decode_tokens, policy == "boundary")
            best = shared * args.prefixes * (args.reuse - 1)
            rows.append({"shared_tokens": shared, "inside_vllm_block": shared % block_v != 0,
                         "hit_rate": {**{k: v / total for k, v in hit.items()}, "best": best / total},
                         "hit_tokens": hit,
                         "ratio": hit["kvfleet"] / hit["vllm_unified"] if hit["vllm_unified"] else None})  # fmt: skip
            log.info("%s: shared %5d: kvfleet %.3f (defaults %.3f) vs unified %.3f (best %.3f) [%.1f s]", policy,
                     shared, *(hit[k] / total for k in ("kvfleet", "kvfleet_defaults", "vllm_unified")), best / total,
                     time.perf_counter() - t0)  # fmt: skip
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
                r["hit_tokens"]["kvfleet"] > r["hit_tokens"]["vllm_unified"] for r in rows if r["shared_tokens"] < block_v
            ),
            "points_lower": [r["shared_tokens"] for r in rows
                             if r["hit_tokens"]["kvfleet"] < r["hit_tokens"]["vllm_unified"]],
        }  # fmt: skip
    return out


# -- the other two numbers ----------------------------------------------------------------------------
def mamba_decode(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.skip_decode:
        return None
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from mamba_decode import measure_decode  # type: ignore[import-not-found]
    except ImportError as exc:
        log.warning("benchmarks/mamba_decode.py: measure_decode unavailable (%s); mamba_decode_speedup is null", exc)
        return None
    return measure_decode(num_requests=32)


def coordinator_speedup(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.coordinator_json:
        text = Path(args.coordinator_json).read_text().strip().splitlines()[-1]
        return json.loads(text).get("coordinator_min_speedup")
    if not args.run_coordinator:
        return None
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kv_cache_vs_vllm.py"), *args.coordinator_args.split()]
    log.info("running %s", " ".join(cmd))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1]).get("coordinator_min_speedup")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV memory per worker for the capacity numbers")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="running requests whose states are reserved")
    ap.add_argument("--hit-budget-gib", type=float, default=8.0, help="KV memory of the hit-rate runs")
    ap.add_argument("--hit-max-num-seqs", type=int, default=4)
    ap.add_argument("--hit-state-fraction", type=float, default=0.5,
                    help="kvfleet's kv_cache.state_cache_fraction in the hit-rate runs (expected_prefix_tokens is "
                         "the swept shared length); the config defaults are reported as kvfleet_defaults")
    ap.add_argument("--splits", type=int, default=8, help="shared lengths in the sweep")
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--reuse", type=int, default=4, help="requests per prefix")
    ap.add_argument("--unique-tokens", type=int, default=200)
    ap.add_argument("--chunk-tokens", type=int, default=512,
                    help="prefill chunk (scheduler.prefill_chunk_size) of both layouts, rounded down to a multiple "
                         "of vLLM's block (at least one block)")
    ap.add_argument("--kvfleet-chunk-tokens", type=int, default=None,
                    help="kvfleet's own prefill chunk instead (rounded down to 16): e.g. 512, its default")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-decode", action="store_true", help="mamba_decode_speedup: null")
    ap.add_argument("--coordinator-json", help="a file whose last line is kv_cache_vs_vllm.py's JSON")
    ap.add_argument("--run-coordinator", action="store_true", help="run kv_cache_vs_vllm.py for the speedups")
    ap.add_argument("--coordinator-args", default="--runs 1 --num-requests 1000")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    archs = {name: model_arch(name) for name in names}
    vllm = ask_vllm([vllm_shape(name, arch) for name, arch in archs.items()])
    budget = int(args.budget_gib * GIB)
    caps = {name: capacity(arch, vllm[name], budget, args.max_num_seqs) for name, arch in archs.items()}
    for name, cap in caps.items():
        log.info("%s: tokens/GiB ideal %.0f, kvfleet %.0f, padded %.0f, vLLM unified %.0f (block %d)", name,
                 *(cap["tokens_per_gib"][k] for k in ("ideal", "kvfleet", "padded", "vllm_unified")),
                 cap["vllm_block_size"]["kvfleet_state"])  # fmt: skip
    hits = hit_sweep(archs[names[0]], caps[names[0]], vllm[names[0]], args)
    decode = mamba_decode(args)
    coordinator = coordinator_speedup(args)
    report = {
        "capacity_over_ideal": {n: c["over_ideal"]["kvfleet"] for n, c in caps.items()},
        "capacity_vs_padded": {n: c["tokens"]["kvfleet"] / c["tokens"]["padded"] for n, c in caps.items()},
        "capacity_vs_vllm_unified": {n: c["tokens"]["kvfleet"] / c["tokens"]["vllm_unified"] for n, c in caps.items()},
        "hit_rate_vs_vllm_unified": hits["boundary"]["ratio"],
        "mamba_decode_speedup": decode.get("mamba_decode_speedup") if decode else None,
        "coordinator_min_speedup": coordinator,
        "details": {"budget_gib": args.budget_gib, "max_num_seqs": args.max_num_seqs, "dtype": DTYPE,
                    "block_size": BLOCK, "capacity": caps, "hit_rate": hits, "mamba_decode": decode},
    }  # fmt: skip
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
