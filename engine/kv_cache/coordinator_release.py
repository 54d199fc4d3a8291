"""Giving blocks back in a ``HybridCoordinator``: finished requests, left-behind window blocks, failed computes.

``free`` releases every block of a request (with retention, the shared-prefix blocks go to the
retained tier); ``remove_skipped_blocks`` releases blocks no group needs any more;
``discard_uncomputed`` takes blocks whose compute failed out of the prefix cache.
"""

from __future__ import annotations

from engine.kv_cache.block_pool import Block


class CoordinatorRelease:
    """The ``HybridCoordinator`` methods that release blocks (mixin, no state of its own).

    Works on the coordinator's ``_admitted`` requests, ``managers`` and pools. Invariants: a freed
    request leaves ``_admitted`` and holds no block in any group; ``free`` of an unknown request
    is a no-op; each group releases its blocks tail first.
    """


    def discard_uncomputed(self, request_id: str, num_computed: int) -> None:
        """Take out of the prefix cache every block of the request holding positions at or past
        ``num_computed`` (their compute failed, so what ``allocate_slots`` registered for them
        was never written); hits and pins before that point stay. Call before ``free``."""
        state = self._admitted.get(request_id)
        if state is None:
            return
        stale = []
        for manager in self.managers:
            table = manager.tables.get(request_id, [])
            stale = [b for b in table[num_computed // manager.block_size :] if not b.is_null and not b.pin]
            manager.pool.evict(stale)
        state.cached_upto = min(state.cached_upto, num_computed)

    def remove_skipped_blocks(self, request_id: str, num_computed: int) -> None:
        """Release blocks no group needs any more once ``num_computed`` tokens are computed."""
        state = self._admitted.get(request_id)
        if state is None:
            return
        for manager in self._droppers:
            manager.remove_skipped_blocks(request_id, num_computed)
        if num_computed > state.removed_upto:
            state.removed_upto = num_computed

    def free(self, request_id: str) -> None:
        """Release every block of the request, group by group, tail first. Idempotent.

        With retention on, the blocks a hit at the request's shared-prefix boundary needs (the
        prefix other requests share) go to the retained tier rather than the free queue.
        """
        state = self._admitted.pop(request_id, None)
        if state is None:
            return
        managers = self.managers
        if self._retain_shared_prefix and state.shared_prefix:
            boundary = state.shared_prefix
            if self._free_together:
                self._free_retaining_together(request_id, boundary)
                return
            for manager in managers:
                manager.free(request_id, manager.blocks_needed_at(boundary))
        elif len(managers) == 1 or not self._single_pool:
            for manager in managers:
                manager.free(request_id)
        else:
            # One pool: release every group's live blocks (each group's tail first) in one pass.
            # Across groups only the order of uncached blocks at the free queue's head differs
            # from group-by-group frees, which no hit can observe.
            blocks: list[Block] = []
            for manager in managers:
                blocks += manager.pop_live(request_id)
            self.pool.free_blocks(blocks)

    def _free_retaining_together(self, request_id: str, boundary: int) -> None:
        """``free`` with retention in one pool with no Mamba group and no retained-tier cap: what
        the groups' ``free(request_id, blocks_needed_at(boundary))`` calls would do, in as few
        pool calls as there are runs of released-to-free / retained blocks (group order, each
        group's tail first). Cached blocks reach the same queue positions, pinned ones their tiers
        in the same order, events come in the same order (no cap: no demotion in between); only
        uncached blocks at the free queue's head may come in another order, which no hit sees."""
        pool = self.pool
        run: list[Block] = []  # blocks for ``free_blocks``, in release order
        for manager in self.managers:
            item = manager.pop_release(request_id, boundary)
            if item is None:
                continue
            ordered, start, stop = item
            if start == stop:
                run += ordered
                continue
            if run:
                run += ordered[:start]
                pool.free_blocks(run, enforce=False)
            elif start:
                pool.free_blocks(ordered[:start], enforce=False)
            pool.free_retaining(ordered[start:stop])
            run = ordered[stop:]
        if run:
            pool.free_blocks(run, enforce=False)
