"""Time to re-establish a pin by copying it from a holder over the transfer backend, against
computing it, for the same prefix in the same run (``repin_transfer_over_recompute``).

On a P/D cluster (the workers have a transfer backend) with two prefill workers A and B, for
each trial prefix: A places the pin by computing it (no holder to copy from), then B places the
same pin copying it from A (``EngineWorker.place_pin`` with A as the source). Each worker times
its own placement from the moment the pin action reaches its engine thread to the pin
(``pin_log``'s ``seconds``). The direction alternates between trials. Before the trials, one
small copy each way opens the connection between the two workers (a first NIXL read from a new
peer pays its setup; it is reported on its own as ``first_contact_s``).

The pins are placed on the workers directly, not through the router (it ignores results of pins
it did not create), and removed again at the end.
"""

from __future__ import annotations

import logging
import random
import statistics
from typing import Any

from configs import ClusterConfig

log = logging.getLogger(__name__)

PIN_ID_BASE = 1_000_000  # far above the router's own ids


def measure_repin(config: ClusterConfig, prefix_tokens: int = 512, trials: int = 4, seed: int = 7) -> dict[str, Any]:
    """Copy and compute seconds per trial and the ratio of their medians (copy / compute)."""
    import ray

    from cluster.api import Cluster
    from engine.kv_cache.hashing import block_hashes
    from engine.kv_cache.spec import alignment_tokens, hash_block_size
    from engine.routing import PinOn

    router = config.router.model_copy(update={"policy": "kvfleet", "pins": []})
    workers = config.workers.model_copy(update={"num_prefill": max(2, config.workers.num_prefill)})
    cfg = config.model_copy(update={"router": router, "workers": workers})
    rng = random.Random(seed)
    with Cluster(cfg) as cluster:
        prefill = sorted(w for w, info in cluster.infos.items() if info.role == "prefill")[:2]
        groups = list(cluster.infos[prefill[0]].groups)
        hbs, align = hash_block_size(groups), alignment_tokens(groups)
        length = max(align, prefix_tokens - prefix_tokens % align)
        vocab = cluster.vocab_size
        handles = cluster.workers
        placed: list[tuple[str, PinOn]] = []

        def place(worker: str, pin_id: int, tokens: list[int], source: str | None) -> dict[str, Any]:
            action = PinOn(worker, pin_id, block_hashes(tokens, hbs), len(tokens), tuple(tokens), source)
            placed.append((worker, action))
            return ray.get(handles[worker].place_pin.remote(action, handles[source] if source else None))

        def prefix(n: int) -> list[int]:
            return [rng.randint(3, vocab - 1) for _ in range(n)]

        first_contact = []
        for i, (a, b) in enumerate([(prefill[0], prefill[1]), (prefill[1], prefill[0])]):
            small = prefix(align * max(1, 16 // align))
            place(a, PIN_ID_BASE + i, small, None)
            first_contact.append(place(b, PIN_ID_BASE + i, small, a)["seconds"])
        rows = []
        try:
            for t in range(trials):
                a, b = (prefill[0], prefill[1]) if t % 2 == 0 else (prefill[1], prefill[0])
                tokens = prefix(length)
                pin_id = PIN_ID_BASE + 100 + t
                computed = place(a, pin_id, tokens, None)
                copied = place(b, pin_id, tokens, a)
                rows.append(
                    {
                        "holder": a,
                        "target": b,
                        "compute_s": round(computed["seconds"], 4),
                        "copy_s": round(copied["seconds"], 4),
                        "compute_method": computed["method"],
                        "copy_method": copied["method"],
                        "pinned": [computed["pinned"], copied["pinned"]],
                    }
                )
                log.info("repin trial %d: %s", t, rows[-1])
        finally:
            for worker, action in placed:
                handles[worker].unpin.remote(action.block_hashes, action.num_tokens)
    valid = [r for r in rows if r["copy_method"] == "copy" and r["pinned"] == [length, length]]
    compute = statistics.median(r["compute_s"] for r in valid) if valid else None
    copy = statistics.median(r["copy_s"] for r in valid) if valid else None
    return {
        "prefix_tokens": length,
        "trials": rows,
        "first_contact_s": [round(s, 4) for s in first_contact],
        "compute_p50_s": compute,
        "copy_p50_s": copy,
        "repin_transfer_over_recompute": round(copy / compute, 4) if compute and copy is not None else None,
    }
