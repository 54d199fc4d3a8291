"""The scheduler operations (each ends with ``check()``): arrivals, first admission (lookup,
external tokens, allocate, compute), advancing with FCFS preemption, step end with sampling,
finishing, load completion or failure, aborts and window maintenance; plus the prefill ``split``.
"""

from __future__ import annotations

from engine.kv_cache import CacheRequest
from kvfleet_testing.kv_cache_sim.records import FINISHED, LOADING, RUNNING, WAITING, SimRequest


class SimOperations:
    """Mixin of ``Sim`` (owns no state): the scheduler is modelled on ``engine.scheduler``. An allocation
    failure preempts (free, ``num_computed = 0``, requeue, tokens kept); no admission follows a
    preemption in the same step; a LOADING request computes nothing until its load completes."""

    # ------------------------------------------------------------------------------------------------
    # chunking
    def split(self, req: CacheRequest, start: int, chunk: int, aligned: bool) -> int:
        """Tokens to schedule from ``start``: at most ``chunk`` (at least 1), cut on alignment
        boundaries below the last cacheable position when ``aligned`` (always with Mamba, and
        never across a Mamba block boundary from the middle of a block)."""
        n = req.num_tokens
        end = start + max(1, min(chunk, n - start))
        if not (aligned or self.has_mamba):
            return end - start
        unit = self.alignment
        last = n - n % unit
        if end < last:
            down = end - end % unit
            end = down if down > start else min(start - start % unit + unit, last)
        stops = [last] + [start - start % b + b for b in self.mamba_sizes if start % b]
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
        sources = [b for b in self.bases]
        sources += [r.req.token_ids for r in self.reqs.values()]
        sources += [r.req.token_ids for r in self.finished]
        src = sources[source % len(sources)]
        tokens = list(src[: cut % (len(src) + 1)]) + [t % self.cfg.vocab for t in suffix]
        tokens = tokens[: self.max_len - 1] or [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = CacheRequest(rid, tokens, self.coord.hash_block_size, cache_salt=salt, remote_prefill=remote)
        self.reqs[rid] = SimRequest(req, max_tokens=max(1, max_tokens))
        self.note(f"arrive {rid} n={len(tokens)} remote={remote} salt={salt}")
        self.tag("arrive")
        self.check()
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
        if self.preempted_this_step:
            return "admit_blocked"
        waiting = self.live(WAITING)
        if not waiting:
            return "admit_none"
        r = waiting[index % len(waiting)]
        req = r.req
        n = req.num_tokens
        skip = req.remote_prefill and self.has_mamba
        hit = self.coord.get_computed_blocks(req)
        self.check_hit(req, hit, n - 1, skip, "lookup")
        local = hit.num_tokens
        if local:
            self.tag("hit")
        if hit.partial:
            self.tag("partial_hit")
        room = n - 1 - local
        ext = room if req.remote_prefill else max(0, min(ext, room))
        if hit.partial and ext == 0 and relookup:
            # No external state would back the partial hit: redo the reconciled lookup.
            hit = self.coord.find_longest_cache_hit(req.block_hashes, n - 1)
            self.check_hit(req, hit, n - 1, False, "relookup")
            local = hit.num_tokens
            ext = 0
            self.tag("relookup")
        load_async = ext > 0 and (async_load or req.remote_prefill)
        start = local + ext
        num_new = 0 if load_async else self.split(req, start, chunk, aligned)
        ids = self.allocate(r, num_new, hit=hit, ext=ext, delay=load_async, reserved=reserved)
        if ids is None:
            self.check()
            return "admit_fail"
        self.next_order += 1
        r.order = self.next_order
        if ext:
            self.tag("external")
        if load_async:
            r.state = LOADING
            r.load = (local, start)
            req.num_computed_tokens = start
            self.tag("async_load")
            outcome = "admit_async"
        else:
            if ext or hit.partial:
                self.load(r, local, start, "sync load")
            self.compute(r, start, start + num_new, "admit")
            req.num_computed_tokens = start + num_new
            req.remote_prefill = False
            r.state = RUNNING
            self.scheduled.append(r.rid)
            outcome = "admit"
        self.check()
        return outcome

    def _victim(self, r: SimRequest, policy: int) -> SimRequest:
        """FCFS: the newest running request not yet scheduled in this step (the requester itself
        when none is left); with ``policy % 3 == 2`` any such request."""
        running = sorted(
            (x for x in self.live(RUNNING) if x.rid not in self.scheduled and x is not r), key=lambda x: x.order
        )
        if not running:
            return r
        if policy % 3 == 2:
            return running[policy % len(running)]
        return running[-1]

    def preempt(self, r: SimRequest) -> None:
        self.free_request(r.rid)
        r.req.num_computed_tokens = 0
        r.state = WAITING
        r.preemptions += 1
        if r.rid in self.scheduled:
            self.scheduled.remove(r.rid)
        self.preempted_this_step = True
        self.note(f"preempt {r.rid}")
        self.tag("preempt")
        self.check()

    def advance(
        self, index: int, chunk: int = 1 << 20, aligned: bool = True, reserved: int = 0, policy: int = 0
    ) -> str:
        """Schedule a running request's next prefill chunk or decode token; preempt on failure."""
        cands = [r for r in self.live(RUNNING) if r.rid not in self.scheduled]
        if not cands:
            return "advance_none"
        r = cands[index % len(cands)]
        req = r.req
        start = req.num_computed_tokens
        if start >= req.num_tokens:
            self.fail(f"{r.rid} running with nothing to compute ({start}/{req.num_tokens})")
        num_new = self.split(req, start, chunk, aligned)
        while True:
            ids = self.allocate(r, num_new, reserved=reserved)
            if ids is not None:
                break
            victim = self._victim(r, policy)
            self.preempt(victim)
            if victim is r:
                return "advance_preempted_self"
        self.compute(r, start, start + num_new, "advance")
        req.num_computed_tokens = start + num_new
        self.scheduled.append(r.rid)
        self.tag("decode" if num_new == 1 and start == req.num_tokens - 1 else "prefill_chunk")
        self.check()
        return "advance"

    def _sample(self, req: CacheRequest, sample: int) -> int:
        if sample % 4:  # greedy: a function of the recent context, so equal prefixes continue equally
            return (sum(req.token_ids[-3:]) * 7 + req.num_tokens) % self.cfg.vocab
        return (sample >> 2) % self.cfg.vocab

    def end_step(self, sample: int = 1) -> str:
        """Step outputs: requests whose computed count reached their length sample a token."""
        for rid in list(self.scheduled):
            r = self.reqs.get(rid)
            if r is None or r.state != RUNNING:
                continue
            req = r.req
            if req.num_computed_tokens == req.num_tokens:
                req.append_token_ids([self._sample(req, sample)])
                r.generated += 1
                sample = sample * 1103515245 + 12345
                if r.generated >= r.max_tokens or req.num_tokens >= self.max_len:
                    self.finish(r, "finished")
        self.commit()
        self.scheduled.clear()
        self.preempted_this_step = False
        self.coord.new_step()
        self.note("end_step")
        self.check()
        return "end_step"

    def finish(self, r: SimRequest, why: str) -> None:
        if r.state == RUNNING and r.req.num_computed_tokens:
            self.coord.remove_skipped_blocks(r.rid, r.req.num_computed_tokens)
        self.free_request(r.rid)
        r.state = FINISHED
        r.load = None
        self.reqs.pop(r.rid, None)
        if r.rid in self.scheduled:
            self.scheduled.remove(r.rid)
        self.finished.append(r)
        self.note(f"{why} {r.rid}")
        self.tag(why)

    def complete_load(self, index: int, outcome: int = 0, cut: int = 0) -> str:
        """An asynchronous load finishes: ok (0), fails entirely (1), or (full attention only)
        fails from some block on (2): the valid prefix is cached and the rest recomputed."""
        loading = self.live(LOADING)
        if not loading:
            return "load_none"
        r = loading[index % len(loading)]
        req = r.req
        local, total = r.load  # type: ignore[misc]
        kind = outcome % 3
        if kind == 2 and not self.all_full:
            kind = 0
        if kind == 2:
            total = local + (cut % (total - local + 1)) // self.alignment * self.alignment
            if total == 0:
                kind = 1
        if kind == 1:
            self.free_request(r.rid)
            req.num_computed_tokens = 0
            r.state = WAITING
            r.load = None
            self.note(f"load failed {r.rid}")
            self.tag("load_failed")
            self.check()
            return "load_failed"
        self.load(r, local, total, "load completion")
        self.coord.cache_blocks(req, total)
        req.num_computed_tokens = total
        req.remote_prefill = False
        r.state = RUNNING
        r.load = None
        self.next_order += 1
        r.order = self.next_order
        self.note(f"load done {r.rid} computed={total}")
        self.tag("load_truncated" if kind == 2 else "load_done")
        self.check()
        return "load_done"

    def abort(self, index: int, twice: bool = False) -> str:
        """Abort any request (waiting, running, loading); sometimes free it twice or free a
        finished one again (idempotence)."""
        everyone = list(self.reqs.values())
        if not everyone or index % 7 == 6:
            rid = self.finished[index % len(self.finished)].rid if self.finished else "never-seen"
            self.coord.free(rid)
            self.note(f"free again {rid}")
            self.check()
            return "free_again"
        r = everyone[index % len(everyone)]
        state = r.state
        self.finish(r, "abort")
        if twice:
            self.coord.free(r.rid)
        self.check()
        return f"abort_{state}"

    def remove_skipped(self, index: int, back: int = 0) -> str:
        running = self.live(RUNNING)
        if not running:
            return "skip_none"
        r = running[index % len(running)]
        n = max(0, r.req.num_computed_tokens - back)
        self.coord.remove_skipped_blocks(r.rid, n)
        self.note(f"remove_skipped_blocks({r.rid}, {n})")
        self.check()
        return "remove_skipped"
