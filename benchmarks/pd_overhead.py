"""What prefill/decode disaggregation costs a request's first token at low load.

``measure_pd_overhead`` runs the same prompts, one at a time, on a 1 prefill + 1 decode cluster
(every prompt split) and on a single worker that does both, both up at once, each prompt on
one then the other (same machine, same prompts, fresh caches), and reports
``pd_ttft_overhead_ratio`` = TTFT p50 of the P/D cluster over the single worker's, with the P/D
requests' breakdown per hop (``summarise_hops``: p50 / p90 / mean of each hop of
``ClusterCompletion.hops``; see ``actors.hops`` for what each hop covers).

    python -m benchmarks.pd_overhead --config tiny --requests 4     # last line: the JSON result

    from benchmarks.pd_overhead import measure_pd_overhead
    print(measure_pd_overhead(load_config("local"))["pd_ttft_overhead_ratio"])
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from benchmarks.support.stats import percentile
from configs import ClusterConfig
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OverheadWorkload:
    """Low load: ``num_requests`` distinct prompts of ``prompt_tokens`` tokens, one in flight."""

    num_requests: int = 16
    prompt_tokens: int = 272
    max_tokens: int = 4
    warmup: int = 2
    seed: int = 0

    def prompts(self, vocab_size: int, count: int, salt: int = 0) -> list[list[int]]:
        rng = random.Random(self.seed * 1000 + salt)
        return [[rng.randint(3, vocab_size - 1) for _ in range(self.prompt_tokens)] for _ in range(count)]


def summarise_hops(completions: Iterable[Any]) -> dict[str, dict[str, float]]:
    """Per hop of the completions' ``hops``: p50, p90 and mean seconds (and how many had it)."""
    values: dict[str, list[float]] = {}
    for completion in completions:
        for hop, seconds in (getattr(completion, "hops", None) or {}).items():
            values.setdefault(hop, []).append(seconds)
    return {
        hop: {
            "p50": round(percentile(vs, 0.5), 5),
            "p90": round(percentile(vs, 0.9), 5),
            "mean": round(statistics.fmean(vs), 5),
            "n": len(vs),
        }
        for hop, vs in values.items()
    }


def _shape(config: ClusterConfig, num_prefill: int, num_decode: int) -> ClusterConfig:
    workers = config.workers.model_copy(update={"num_prefill": num_prefill, "num_decode": num_decode})
    router = config.router.model_copy(update={"pins": [], "decode_only_threshold_tokens": 0})
    return config.model_copy(update={"workers": workers, "router": router})


def _measure(
    pd_config: ClusterConfig, single_config: ClusterConfig, workload: OverheadWorkload
) -> tuple[list[Any], list[Any]]:
    """Both clusters up at once; the prompts one at a time, each on both in turn (which goes
    first alternates), so drifting machine load hits both alike."""
    from cluster.api import Cluster

    sampling = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)
    with Cluster(pd_config) as pd_cluster, Cluster(single_config) as single_cluster:
        clusters = (pd_cluster, single_cluster)
        vocab = pd_cluster.vocab_size
        for prompt in workload.prompts(vocab, workload.warmup, salt=1):  # first-step costs out of the numbers
            for cluster in clusters:
                cluster.generate([prompt], sampling)
        out: tuple[list[Any], list[Any]] = ([], [])
        for i, prompt in enumerate(workload.prompts(vocab, workload.num_requests)):
            for k in (0, 1) if i % 2 == 0 else (1, 0):
                out[k].append(clusters[k].generate([prompt], sampling)[0])
        return out


def measure_pd_overhead(config: ClusterConfig, workload: OverheadWorkload | None = None) -> dict[str, Any]:
    """TTFT p50 of 1P+1D over one worker doing both, same prompts, one request in flight at a
    time, both clusters up in the same run; with the P/D requests' hops summarised (``hops``)
    and the single worker's (``single_hops``). Starts an embedded Ray for both unless one is up."""
    import ray

    from cluster.placement import embedded_init_kwargs, loopback_environment

    workload = workload or OverheadWorkload()
    owns_ray = not ray.is_initialized()
    if owns_ray:
        loopback_environment()
        if config.ray.address:
            ray.init(address=config.ray.address, namespace=config.ray.namespace)
        else:
            ray.init(**embedded_init_kwargs(_shape(config, 1, 2)))  # room for both clusters' workers
    try:
        pd, single = _measure(_shape(config, 1, 1), _shape(config, 0, 1), workload)
    finally:
        if owns_ray:
            ray.shutdown()
    split = [r for r in pd if r.disaggregated]
    if len(split) < len(pd):
        log.warning("%d of %d requests were not split on the P/D cluster", len(pd) - len(split), len(pd))
    if [r.token_ids for r in pd] != [r.token_ids for r in single]:
        raise RuntimeError("P/D and single-worker tokens differ for the same prompts (greedy)")
    pd_p50 = percentile([r.ttft_s for r in pd], 0.5)
    single_p50 = percentile([r.ttft_s for r in single], 0.5)
    return {
        "requests": len(pd),
        "split": len(split),
        "prompt_tokens": workload.prompt_tokens,
        "pd_ttft_p50_s": round(pd_p50, 4),
        "pd_ttft_p90_s": round(percentile([r.ttft_s for r in pd], 0.9), 4),
        "single_ttft_p50_s": round(single_p50, 4),
        "single_ttft_p90_s": round(percentile([r.ttft_s for r in single], 0.9), 4),
        "pd_ttft_overhead_ratio": round(pd_p50 / single_p50, 4) if single_p50 else None,
        # one decode step of each: the decode worker computes the prompt's last token itself
        # (engine.disagg's N - 1 convention), so P/D's first_token hop is about one of these
        "pd_itl_p50_s": round(percentile([_itl(r) for r in pd], 0.5), 4),
        "single_itl_p50_s": round(percentile([_itl(r) for r in single], 0.5), 4),
        "hops": summarise_hops(split),
        "single_hops": summarise_hops(single),
    }


def _itl(completion: Any) -> float:
    """Mean seconds per output token after the first."""
    return (completion.latency_s - completion.ttft_s) / max(1, len(completion.token_ids) - 1)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.pd_overhead --config local``: print the measurement as JSON."""
    import argparse
    import json

    from configs import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="local")
    parser.add_argument("--set", action="append", default=[], help="dotted config override, e.g. a.b=c")
    parser.add_argument("--requests", type=int, default=OverheadWorkload.num_requests)
    parser.add_argument("--prompt-tokens", type=int, default=OverheadWorkload.prompt_tokens)
    args = parser.parse_args(argv)
    workload = OverheadWorkload(num_requests=args.requests, prompt_tokens=args.prompt_tokens)
    print(json.dumps(measure_pd_overhead(load_config(args.config, args.set), workload)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
