"""A simulated scheduler driving ``HybridCoordinator`` with random operations, checking it after each one.

Shared by the hypothesis state machine (``tests/kv_cache/test_stateful.py``) and the long-running
fuzzer (``benchmarks/kv_cache_fuzz.py``). The scheduler is modelled on ``engine.scheduler``: first
admission = lookup, then ``allocate_slots(hit, external)``; running requests advance by a prefill
chunk or one decode token; an allocation failure preempts (free, ``num_computed = 0``, requeue,
tokens kept); asynchronous loads own blocks but compute nothing until completed, then
``cache_blocks``; remote-prefill requests use the partial (Mamba-less) hit; Mamba configurations cut
prefill chunks on block boundaries (the block-aligned split). Aborts free at any state.

Checks after every operation (``SimChecks.check``):

* ``coord.check_invariants()`` (ref counts, queues, conservation, hash maps, prediction == taken);
* the KV event stream replayed into a shadow index equals the pool's hash maps and pin levels;
* a *data model*: every physical block remembers which token prefix its contents belong to
  (attention: the prefix through the last written position; Mamba: the state after ``e`` tokens).
  A computation must find every position it reads (full: all earlier, SWA: the window, chunked:
  the current chunk, Mamba: the previous state) in non-null blocks holding the request's own
  prefix, and every cached block must hold exactly the prefix its hash names;
* requests waiting for KV own unhashed, exclusively held blocks past their local hit.

And per operation: hits equal a brute-force oracle (largest aligned length every group can serve)
with the per-group block lists of invariant 12; a failed ``allocate_slots`` changes nothing but
window drops of that request, and never fails while the pool obviously has room; explicit pins
pin what a hit at the pinned length needs; at ``drain`` every block is free again and no explicit
pin is left.

Modules, one job each: ``records`` (states, ``SimViolation``, ``SimRequest``, ``Snapshot``,
``PinRecord``), ``configs`` (mixes, ``SimConfig``, sizing, ``random_config``), ``simulator``
(``Sim``: builds the parts below and offers their operations), ``log`` (``SimLog``: counts, trace,
failures), ``request_book`` (``RequestBook``: the simulated requests), ``oracle`` (``HitOracle``),
``data_model`` (``DataModel``: block contents), ``event_shadow`` (``EventShadow``: the event
replay), ``checks`` (``SimChecks``: per-operation checks), ``operations`` (``SimOperations``: the
scheduler), ``cache_ops`` (``CacheOperations``: pins, reset) and ``driver`` (``RandomDriver``,
``OPS``). Every public name is re-exported here.
"""

from __future__ import annotations

from kvfleet_testing.kv_cache_sim.configs import (
    MAX_LEN_CAP,
    MIX_POOLS,
    MIXES,
    SimConfig,
    max_len_for,
    min_blocks_for,
    min_pool_blocks_for,
    mix_pools,
    num_pools,
    random_config,
    random_pool_sizes,
)
from kvfleet_testing.kv_cache_sim.driver import OPS, RandomDriver
from kvfleet_testing.kv_cache_sim.records import (
    FINISHED,
    LOADING,
    RUNNING,
    WAITING,
    PinRecord,
    SimRequest,
    SimViolation,
    Snapshot,
    cdiv,
)
from kvfleet_testing.kv_cache_sim.simulator import Sim

__all__ = [
    "FINISHED",
    "LOADING",
    "MAX_LEN_CAP",
    "MIXES",
    "MIX_POOLS",
    "OPS",
    "RUNNING",
    "WAITING",
    "PinRecord",
    "RandomDriver",
    "Sim",
    "SimConfig",
    "SimRequest",
    "SimViolation",
    "Snapshot",
    "cdiv",
    "max_len_for",
    "min_blocks_for",
    "min_pool_blocks_for",
    "mix_pools",
    "num_pools",
    "random_config",
    "random_pool_sizes",
]
