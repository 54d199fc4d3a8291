"""``Sim``: a simulated scheduler driving one ``HybridCoordinator``, built from parts that each own
one job: ``SimLog`` (log.py: counts, trace, failures), ``RequestBook`` (request_book.py: the
simulated requests), ``HitOracle`` (oracle.py), ``DataModel`` (data_model.py: block contents),
``EventShadow`` (event_shadow.py: the router's index from the event stream), ``SimChecks``
(checks.py), ``SimOperations`` (operations.py: the scheduler) and ``CacheOperations``
(cache_ops.py: pins and resets). ``Sim`` builds them, instruments the pools and offers their
operations under one name each.
"""

from __future__ import annotations

from collections import Counter, deque

from engine.kv_cache import HybridCoordinator
from engine.kv_cache.block_pool import Block, BlockPool
from kvfleet_testing.kv_cache_sim.cache_ops import CacheOperations
from kvfleet_testing.kv_cache_sim.checks import SimChecks
from kvfleet_testing.kv_cache_sim.configs import SimConfig
from kvfleet_testing.kv_cache_sim.data_model import DataModel
from kvfleet_testing.kv_cache_sim.event_shadow import EventShadow
from kvfleet_testing.kv_cache_sim.log import SimLog
from kvfleet_testing.kv_cache_sim.operations import SimOperations
from kvfleet_testing.kv_cache_sim.oracle import HitOracle
from kvfleet_testing.kv_cache_sim.records import SimRequest
from kvfleet_testing.kv_cache_sim.request_book import RequestBook


# -- the simulator -------------------------------------------------------------------------------------------
class Sim:
    """A simulated scheduler driving one ``HybridCoordinator`` (``coord``). Owns the coordinator and
    the parts that check it: ``log``, ``requests``, ``oracle``, ``data`` (the data model; recording
    nothing when ``data_model`` is false), ``shadow`` (``None`` without events), ``checks``, ``ops``
    (the scheduler operations) and ``cache_ops`` (pins, reset). Every operation that acts ends with
    ``checks.check()``, so between operations the coordinator admits exactly the RUNNING and LOADING
    requests, the event shadow equals the pools' hash maps and pin levels, the data model says which
    prefix every written block holds, and ``cache_ops`` counts, per prefix, the ``pin_prefix`` calls
    not yet undone. ``op_index`` is the driver's count of operations."""

    def __init__(self, cfg: SimConfig, data_model: bool = True, trace_len: int = 64) -> None:
        self.cfg = cfg
        self.coord = HybridCoordinator(
            cfg.groups,
            cfg.num_blocks,
            enable_caching=cfg.enable_caching,
            retention=cfg.retention,
            enable_events=cfg.enable_events,
        )
        self.log = SimLog(cfg, trace_len)
        self.requests = RequestBook()
        self.oracle = HitOracle(self.coord, cfg.enable_caching, self.log)
        self.data = DataModel(self.coord.managers, self.log, data_model)
        self.shadow = EventShadow(self.coord, self.log) if cfg.enable_events else None
        self.checks = SimChecks(self.coord, self.requests, self.data, self.shadow, self.log, cfg.retention.enabled)
        self.ops = SimOperations(self.coord, cfg, self.requests, self.oracle, self.data, self.checks, self.log)
        self.cache_ops = CacheOperations(self.coord, self.requests, self.oracle, self.checks, self.log)
        self.op_index = 0
        for pool in self.coord.pools:
            self._instrument(pool)
        self.checks.check()

    def _instrument(self, pool: BlockPool) -> None:
        """Instrumentation only: the data model learns of fresh blocks, the log counts demotions
        under pressure."""
        real_demote = pool.demote
        real_get_new_blocks = pool.get_new_blocks
        data = self.data
        log = self.log

        def recording_get_new_blocks(n: int) -> list[Block]:
            blocks = real_get_new_blocks(n)
            data.record_fresh(blocks)
            return blocks

        def counting_demote(n: int) -> int:
            done = real_demote(n)
            if done:
                log.tag("demoted_blocks", done)
            return done

        pool.demote = counting_demote  # type: ignore[method-assign]
        pool.get_new_blocks = recording_get_new_blocks  # type: ignore[method-assign]

    # -- what a run reports --------------------------------------------------------------------------------
    @property
    def counts(self) -> Counter[str]:
        return self.log.counts

    @property
    def trace(self) -> deque[str]:
        return self.log.trace

    @property
    def max_len(self) -> int:
        return self.ops.max_len

    def live(self, *states: str) -> list[SimRequest]:
        return self.requests.live(*states)

    # -- the operations (each returns its outcome) ---------------------------------------------------------
    def arrive(
        self,
        source: int,
        cut: int,
        suffix: list[int],
        max_tokens: int,
        remote: bool = False,
        salt: str | None = None,
    ) -> str:
        return self.ops.arrive(source, cut, suffix, max_tokens, remote, salt)

    def admit(
        self,
        index: int,
        ext: int = 0,
        chunk: int = 1 << 20,
        async_load: bool = False,
        aligned: bool = True,
        reserved: int = 0,
        relookup: bool = True,
    ) -> str:
        return self.ops.admit(index, ext, chunk, async_load, aligned, reserved, relookup)

    def advance(
        self, index: int, chunk: int = 1 << 20, aligned: bool = True, reserved: int = 0, policy: int = 0
    ) -> str:
        return self.ops.advance(index, chunk, aligned, reserved, policy)

    def end_step(self, sample: int = 1) -> str:
        return self.ops.end_step(sample)

    def complete_load(self, index: int, outcome: int = 0, cut: int = 0) -> str:
        return self.ops.complete_load(index, outcome, cut)

    def abort(self, index: int, twice: bool = False) -> str:
        return self.ops.abort(index, twice)

    def remove_skipped(self, index: int, back: int = 0) -> str:
        return self.ops.remove_skipped(index, back)

    def pin(self, source: int, length: int) -> str:
        return self.cache_ops.pin(source, length)

    def unpin(self, index: int) -> str:
        return self.cache_ops.unpin(index)

    def reset(self) -> str:
        return self.cache_ops.reset()

    def drain(self) -> str:
        """Abort everything, release every explicit pin: the pool must be whole again."""
        for r in self.requests.everyone():
            self.ops.finish(r, "abort")
            self.checks.check()
        self.cache_ops.unpin_all()
        self.checks.check_drained()
        self.ops.close_step()
        self.checks.check()
        self.log.tag("drain")
        return "drain"
