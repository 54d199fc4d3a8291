"""The scheduler operations (each ends with ``check()``): arrivals, first admission (lookup,
external tokens, allocate, compute), advancing with FCFS preemption, step end with sampling,
finishing, load completion or failure, aborts and window maintenance; plus the prefill ``split``.
"""

from __future__ import annotations

import random

from engine.kv_cache import CacheRequest, HybridCoordinator
from engine.kv_cache.attention_managers import FullAttentionManager
from engine.kv_cache.mamba_manager import MambaManager
from kvfleet_testing.kv_cache_sim.checks import SimChecks
from kvfleet_testing.kv_cache_sim.configs import SimConfig, max_len_for
from kvfleet_testing.kv_cache_sim.data_model import DataModel
from kvfleet_testing.kv_cache_sim.log import SimLog
from kvfleet_testing.kv_cache_sim.oracle import HitOracle
from kvfleet_testing.kv_cache_sim.records import FINISHED, LOADING, RUNNING, WAITING, SimRequest
from kvfleet_testing.kv_cache_sim.request_book import RequestBook


class SimOperations:
    """The simulated scheduler, modelled on ``engine.scheduler``, driving one coordinator. Owns the
    three shared base sequences (``bases``, drawn from ``cfg.seed``) arrivals copy prefixes from,
    ``max_len`` (no request grows to it) and the coordinator's shape it chunks by (alignment, Mamba
    block sizes); the requests live in the ``RequestBook``, block contents in the ``DataModel``.
    An allocation failure preempts (free, ``num_computed = 0``, requeue, tokens kept); no admission
    follows a preemption in the same step; a LOADING request computes nothing until its load
    completes. Every operation that acts ends with ``checks.check()``."""

    def __init__(
        self,
        coord: HybridCoordinator,
        cfg: SimConfig,
        requests: RequestBook,
        oracle: HitOracle,
        data: DataModel,
        checks: SimChecks,
        log: SimLog,
    ) -> None:
        self._coord = coord
        self._vocab = cfg.vocab
        self._requests = requests
        self._oracle = oracle
        self._data = data
        self._checks = checks
        self._log = log
        managers = coord.managers
        self._alignment = coord.alignment
        self._has_mamba = any(isinstance(m, MambaManager) for m in managers)
        self._all_full = all(isinstance(m, FullAttentionManager) for m in managers)
        self._mamba_sizes = sorted({m.block_size for m in managers if isinstance(m, MambaManager)})
        self.max_len = max_len_for(cfg.mix, cfg.num_blocks)
        base_rng = random.Random(cfg.seed)
        self._bases = [[base_rng.randrange(cfg.vocab) for _ in range(self.max_len)] for _ in range(3)]

    # ------------------------------------------------------------------------------------------------
    # chunking
    def split(self, req: CacheRequest, start: int, chunk: int, aligned: bool) -> int:
        """Tokens to schedule from ``start``: at most ``chunk`` (at least 1), cut on alignment
        boundaries below the last cacheable position when ``aligned`` (always with Mamba, and
        never across a Mamba block boundary from the middle of a block)."""
        n = req.num_tokens
        end = start + max(1, min(chunk, n - start))
        if not (aligned or self._has_mamba):
            return end - start
        unit = self._alignment
        last = n - n % unit
        if end < last:
            down = end - end % unit
            end = down if down > start else min(start - start % unit + unit, last)
        stops = [last] + [start - start % b + b for b in self._mamba_sizes if start % b]
        cut = [s for s in stops if start < s < end]
        if cut:
            end = min(cut)
        return end - start

    # ------------------------------------------------------------------------------------------------
    # operations (each ends with check())
    def arrive(
        self,
        source: int,
        cut: int,
        suffix: list[int],
        max_tokens: int,
        remote: bool = False,
        salt: str | None = None,
    ) -> str:
        sources = [b for b in self._bases]
        sources += [r.req.token_ids for r in self._requests.known()]
        src = sources[source % len(sources)]
        tokens = list(src[: cut % (len(src) + 1)]) + [t % self._vocab for t in suffix]
        tokens = tokens[: self.max_len - 1] or [0]
        rid = self._requests.new_rid()
        req = CacheRequest(rid, tokens, self._coord.hash_block_size, cache_salt=salt, remote_prefill=remote)
        self._requests.add(SimRequest(req, max_tokens=max(1, max_tokens)))
        self._log.note(f"arrive {rid} n={len(tokens)} remote={remote} salt={salt}")
        self._log.tag("arrive")
        self._checks.check()
        return "arrive_remote" if remote else "arrive"

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
        """First admission of a waiting request: lookup, external tokens, allocate, compute."""
        if self._requests.preempted():
            return "admit_blocked"
        waiting = self._requests.live(WAITING)
        if not waiting:
            return "admit_none"
        r = waiting[index % len(waiting)]
        req = r.req
        n = req.num_tokens
        skip = req.remote_prefill and self._has_mamba
        hit = self._coord.get_computed_blocks(req)
        self._oracle.check_hit(req, hit, n - 1, skip, "lookup")
        local = hit.num_tokens
        if local:
            self._log.tag("hit")
        if hit.partial:
            self._log.tag("partial_hit")
        room = n - 1 - local
        ext = room if req.remote_prefill else max(0, min(ext, room))
        if hit.partial and ext == 0 and relookup:
            # No external state would back the partial hit: redo the reconciled lookup.
            hit = self._coord.find_longest_cache_hit(req.block_hashes, n - 1)
            self._oracle.check_hit(req, hit, n - 1, False, "relookup")
            local = hit.num_tokens
            ext = 0
            self._log.tag("relookup")
        load_async = ext > 0 and (async_load or req.remote_prefill)
        start = local + ext
        num_new = 0 if load_async else self.split(req, start, chunk, aligned)
        ids = self._checks.allocate(r, num_new, hit=hit, ext=ext, delay=load_async, reserved=reserved)
        if ids is None:
            self._checks.check()
            return "admit_fail"
        self._requests.stamp_order(r)
        if ext:
            self._log.tag("external")
        if load_async:
            r.state = LOADING
            r.load = (local, start)
            req.num_computed_tokens = start
            self._log.tag("async_load")
            outcome = "admit_async"
        else:
            if ext or hit.partial:
                self._data.load(r, local, start, "sync load")
            self._data.compute(r, start, start + num_new, "admit")
            req.num_computed_tokens = start + num_new
            req.remote_prefill = False
            r.state = RUNNING
            self._requests.schedule(r.rid)
            outcome = "admit"
        self._checks.check()
        return outcome

    def _victim(self, r: SimRequest, policy: int) -> SimRequest:
        """FCFS: the newest running request not yet scheduled in this step (the requester itself
        when none is left); with ``policy % 3 == 2`` any such request."""
        running = sorted(
            (x for x in self._requests.live(RUNNING) if not self._requests.is_scheduled(x.rid) and x is not r),
            key=lambda x: x.order,
        )
        if not running:
            return r
        if policy % 3 == 2:
            return running[policy % len(running)]
        return running[-1]

    def preempt(self, r: SimRequest) -> None:
        self._checks.free_request(r.rid)
        r.req.num_computed_tokens = 0
        r.state = WAITING
        r.preemptions += 1
        self._requests.unschedule(r.rid)
        self._requests.mark_preempted()
        self._log.note(f"preempt {r.rid}")
        self._log.tag("preempt")
        self._checks.check()

    def advance(
        self, index: int, chunk: int = 1 << 20, aligned: bool = True, reserved: int = 0, policy: int = 0
    ) -> str:
        """Schedule a running request's next prefill chunk or decode token; preempt on failure."""
        cands = [r for r in self._requests.live(RUNNING) if not self._requests.is_scheduled(r.rid)]
        if not cands:
            return "advance_none"
        r = cands[index % len(cands)]
        req = r.req
        start = req.num_computed_tokens
        if start >= req.num_tokens:
            self._log.fail(f"{r.rid} running with nothing to compute ({start}/{req.num_tokens})")
        num_new = self.split(req, start, chunk, aligned)
        while True:
            ids = self._checks.allocate(r, num_new, reserved=reserved)
            if ids is not None:
                break
            victim = self._victim(r, policy)
            self.preempt(victim)
            if victim is r:
                return "advance_preempted_self"
        self._data.compute(r, start, start + num_new, "advance")
        req.num_computed_tokens = start + num_new
        self._requests.schedule(r.rid)
        self._log.tag("decode" if num_new == 1 and start == req.num_tokens - 1 else "prefill_chunk")
        self._checks.check()
        return "advance"

    def _sample(self, req: CacheRequest, sample: int) -> int:
        if sample % 4:  # greedy: a function of the recent context, so equal prefixes continue equally
            return (sum(req.token_ids[-3:]) * 7 + req.num_tokens) % self._vocab
        return (sample >> 2) % self._vocab

    def end_step(self, sample: int = 1) -> str:
        """Step outputs: requests whose computed count reached their length sample a token."""
        for rid in self._requests.scheduled():
            r = self._requests.get(rid)
            if r is None or r.state != RUNNING:
                continue
            req = r.req
            if req.num_computed_tokens == req.num_tokens:
                req.append_token_ids([self._sample(req, sample)])
                r.generated += 1
                sample = sample * 1103515245 + 12345
                if r.generated >= r.max_tokens or req.num_tokens >= self.max_len:
                    self.finish(r, "finished")
        self.close_step()
        self._log.note("end_step")
        self._checks.check()
        return "end_step"

    def close_step(self) -> None:
        """The step's forward is over: pending Mamba states land, the schedule empties and the
        coordinator starts a new step."""
        self._data.commit()
        self._requests.new_step()
        self._coord.new_step()

    def finish(self, r: SimRequest, why: str) -> None:
        """``r`` finished (``why``: "finished" or "abort"): its window drops, then freed and retired."""
        if r.state == RUNNING and r.req.num_computed_tokens:
            self._coord.remove_skipped_blocks(r.rid, r.req.num_computed_tokens)
        self._checks.free_request(r.rid)
        r.state = FINISHED
        r.load = None
        self._requests.retire(r)
        self._log.note(f"{why} {r.rid}")
        self._log.tag(why)

    def complete_load(self, index: int, outcome: int = 0, cut: int = 0) -> str:
        """An asynchronous load finishes: ok (0), fails entirely (1), or (full attention only)
        fails from some block on (2): the valid prefix is cached and the rest recomputed."""
        loading = self._requests.live(LOADING)
        if not loading:
            return "load_none"
        r = loading[index % len(loading)]
        req = r.req
        local, total = r.load  # type: ignore[misc]
        kind = outcome % 3
        if kind == 2 and not self._all_full:
            kind = 0
        if kind == 2:
            total = local + (cut % (total - local + 1)) // self._alignment * self._alignment
            if total == 0:
                kind = 1
        if kind == 1:
            self._checks.free_request(r.rid)
            req.num_computed_tokens = 0
            r.state = WAITING
            r.load = None
            self._log.note(f"load failed {r.rid}")
            self._log.tag("load_failed")
            self._checks.check()
            return "load_failed"
        self._data.load(r, local, total, "load completion")
        self._coord.cache_blocks(req, total)
        req.num_computed_tokens = total
        req.remote_prefill = False
        r.state = RUNNING
        r.load = None
        self._requests.stamp_order(r)
        self._log.note(f"load done {r.rid} computed={total}")
        self._log.tag("load_truncated" if kind == 2 else "load_done")
        self._checks.check()
        return "load_done"

    def abort(self, index: int, twice: bool = False) -> str:
        """Abort any request (waiting, running, loading); sometimes free it twice or free a
        finished one again (idempotence)."""
        everyone = self._requests.everyone()
        if not everyone or index % 7 == 6:
            finished = self._requests.finished()
            rid = finished[index % len(finished)].rid if finished else "never-seen"
            self._coord.free(rid)
            self._log.note(f"free again {rid}")
            self._checks.check()
            return "free_again"
        r = everyone[index % len(everyone)]
        state = r.state
        self.finish(r, "abort")
        if twice:
            self._coord.free(r.rid)
        self._checks.check()
        return f"abort_{state}"

    def remove_skipped(self, index: int, back: int = 0) -> str:
        running = self._requests.live(RUNNING)
        if not running:
            return "skip_none"
        r = running[index % len(running)]
        n = max(0, r.req.num_computed_tokens - back)
        self._coord.remove_skipped_blocks(r.rid, n)
        self._log.note(f"remove_skipped_blocks({r.rid}, {n})")
        self._checks.check()
        return "remove_skipped"
