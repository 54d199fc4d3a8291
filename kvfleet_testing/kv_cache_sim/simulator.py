"""``Sim``: the simulated scheduler's state (the coordinator it drives, the simulated requests, the
data model, the event shadow, pins held) and its construction, instrumentation and small helpers.
The behaviour lives in mixins, one job each: ``HitOracle`` (oracle.py), ``DataModel``
(data_model.py), ``SimChecks`` (checks.py), ``SimOperations`` (operations.py) and ``CacheOperations``
(cache_ops.py).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

from engine.kv_cache import HybridCoordinator
from engine.kv_cache.attention_managers import FullAttentionManager
from engine.kv_cache.mamba_manager import MambaManager
from engine.kv_cache.manager_base import SingleTypeManager
from kvfleet_testing.kv_cache_sim.cache_ops import CacheOperations
from kvfleet_testing.kv_cache_sim.checks import SimChecks
from kvfleet_testing.kv_cache_sim.configs import SimConfig, max_len_for
from kvfleet_testing.kv_cache_sim.data_model import DataModel
from kvfleet_testing.kv_cache_sim.operations import SimOperations
from kvfleet_testing.kv_cache_sim.oracle import HitOracle
from kvfleet_testing.kv_cache_sim.records import PinRecord, SimRequest, SimViolation


# -- the simulator -------------------------------------------------------------------------------------------
@dataclass
class Sim(SimOperations, CacheOperations, SimChecks, DataModel, HitOracle):
    """A simulated scheduler driving one ``HybridCoordinator``. Every operation that acts ends with
    ``check()``, so between operations the coordinator admits exactly the RUNNING and LOADING
    requests, the event shadow (``stored``, ``pinned``) equals the pools' hash maps and pin levels,
    ``content`` says which prefix every written block holds, and ``held`` counts, per prefix, the
    ``pin_prefix`` calls not yet undone."""

    cfg: SimConfig
    data_model: bool = True
    trace_len: int = 64
    coord: HybridCoordinator = field(init=False)
    counts: Counter = field(init=False, default_factory=Counter)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.coord = HybridCoordinator(
            cfg.groups,
            cfg.num_blocks,
            enable_caching=cfg.enable_caching,
            retention=cfg.retention,
            enable_events=cfg.enable_events,
        )
        self.pools = self.coord.pools
        self.group_pool = self.coord.group_pool
        self.managers: list[SingleTypeManager] = self.coord.managers
        self.alignment = self.coord.alignment
        self.has_mamba = any(isinstance(m, MambaManager) for m in self.managers)
        self.all_full = all(isinstance(m, FullAttentionManager) for m in self.managers)
        self.mamba_sizes = sorted({m.block_size for m in self.managers if isinstance(m, MambaManager)})
        self.max_len = max_len_for(cfg.mix, cfg.num_blocks)
        base_rng = random.Random(cfg.seed)
        self.bases = [[base_rng.randrange(cfg.vocab) for _ in range(self.max_len)] for _ in range(3)]
        self.reqs: dict[str, SimRequest] = {}
        self.finished: deque[SimRequest] = deque(maxlen=12)
        self.scheduled: list[str] = []
        self.preempted_this_step = False
        self.pins: list[PinRecord] = []
        self.held: Counter = Counter()  # pins that pinned something, per prefix (same arguments)
        # data model: (pool, block id) -> (group, first valid position, end, prefix key of the request through end)
        self.content: dict[tuple[int, int], tuple[int, int, int, tuple]] = {}
        # Mamba states are written at the end of the forward: pending until end_step (block -> (rid, content))
        self.pending: dict[tuple[int, int], tuple[str, tuple[int, int, int, tuple]]] = {}
        # event shadow of the router's index
        self.stored: set[tuple[int, bytes]] = set()
        self.pinned: dict[tuple[int, bytes], int] = {}
        self.last_seq = 0
        self.next_id = 0
        self.next_order = 0
        self.trace: deque[str] = deque(maxlen=self.trace_len)
        self.op_index = 0
        self.fresh: set[tuple[int, int]] = set()  # (pool, id) handed out by get_new_blocks since the last check
        self.hashed_before: set[tuple[int, int]] = set()  # blocks carrying a hash before the last allocation
        for pool in self.pools:
            self._instrument(pool)
        self.check()

    def _instrument(self, pool) -> None:
        """Instrumentation only: remember fresh blocks, count demotions under pressure."""
        real_demote = pool.demote
        real_get_new_blocks = pool.get_new_blocks

        def recording_get_new_blocks(n: int) -> list:
            blocks = real_get_new_blocks(n)
            self.fresh.update((b.pool, b.block_id) for b in blocks)
            return blocks

        def counting_demote(n: int) -> int:
            done = real_demote(n)
            if done:
                self.counts["demoted_blocks"] += done
            return done

        pool.demote = counting_demote  # type: ignore[method-assign]
        pool.get_new_blocks = recording_get_new_blocks  # type: ignore[method-assign]

    # ------------------------------------------------------------------------------------------------
    # helpers
    def fail(self, message: str) -> None:
        raise SimViolation(f"{message}\n  config: {self.cfg.describe()}\n  recent ops: {list(self.trace)[-12:]}")

    def note(self, text: str) -> None:
        self.trace.append(text)

    def tag(self, name: str) -> None:
        self.counts[name] += 1

    def live(self, *states: str) -> list[SimRequest]:
        return [r for r in self.reqs.values() if r.state in states]
