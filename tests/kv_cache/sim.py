"""A simulated scheduler driving ``HybridCoordinator`` with random operations, checking it after each one.

Shared by the hypothesis state machine (``tests/kv_cache/test_stateful.py``) and the long-running
fuzzer (``benchmarks/kv_cache_fuzz.py``). The scheduler follows the reference's §6.5: first
admission = lookup, then ``allocate_slots(hit, external)``; running requests advance by a prefill
chunk or one decode token; an allocation failure preempts (free, ``num_computed = 0``, requeue,
tokens kept); asynchronous loads own blocks but compute nothing until completed, then
``cache_blocks``; remote-prefill requests use the partial (Mamba-less) hit; Mamba configurations cut
prefill chunks on block boundaries (the block-aligned split). Aborts free at any state.

Checks after every operation (``Sim.check``):

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
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache import (
    AllBlocksCleared,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    BlockUnpinned,
    CacheHit,
    CacheRequest,
    ChunkedLocalSpec,
    FullAttentionSpec,
    HybridCoordinator,
    KVCacheGroup,
    MambaSpec,
    RetentionOptions,
    SlidingWindowSpec,
)
from engine.kv_cache.block_queue import PIN_EXPLICIT, PIN_NONE
from engine.kv_cache.managers import (
    ChunkedLocalManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeManager,
    SlidingWindowManager,
)
from engine.kv_cache.spec import alignment_tokens

WAITING = "waiting"
RUNNING = "running"
LOADING = "loading"  # waiting for remote / external KV (owns blocks, computes nothing)
FINISHED = "finished"

MAX_LEN_CAP = 96


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SimViolation(AssertionError):
    """The coordinator broke a property the simulated scheduler checks (beyond check_invariants)."""


# -- configurations ----------------------------------------------------------------------------------
MIXES: dict[str, tuple] = {
    "full": (FullAttentionSpec(4),),
    "full8": (FullAttentionSpec(8),),
    "full+full8": (FullAttentionSpec(4), FullAttentionSpec(8)),
    "full+swa": (FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
    "full8+swa4": (FullAttentionSpec(8), SlidingWindowSpec(4, 12)),
    "full6+swa4": (FullAttentionSpec(6), SlidingWindowSpec(4, 10)),  # hash unit 2, alignment 12
    "full+swa6+swa13": (FullAttentionSpec(4), SlidingWindowSpec(4, 6), SlidingWindowSpec(4, 13)),
    "full+mamba": (FullAttentionSpec(4), MambaSpec(4)),
    "full4+mamba8": (FullAttentionSpec(4), MambaSpec(8)),
    "full8+mamba4": (FullAttentionSpec(8), MambaSpec(4)),  # Mamba states only hit at multiples of 8
    "full+swa+mamba": (FullAttentionSpec(4), SlidingWindowSpec(4, 8), MambaSpec(4)),
    "full+chunked": (FullAttentionSpec(4), ChunkedLocalSpec(4, 8)),
    "swa": (SlidingWindowSpec(4, 7),),
    # several block pools (one per page size): a block id names a block of its group's pool
    "3pool:full|swa|mamba": (FullAttentionSpec(4), SlidingWindowSpec(4, 8), MambaSpec(4)),
    "2pool:full+full8|mamba8": (FullAttentionSpec(4), FullAttentionSpec(8), MambaSpec(8)),
    "2pool:full8|swa4+chunked": (FullAttentionSpec(8), SlidingWindowSpec(4, 12), ChunkedLocalSpec(4, 8)),
}
# The pool each group of a mix draws from (mixes not listed: every group in pool 0).
MIX_POOLS: dict[str, tuple[int, ...]] = {
    "3pool:full|swa|mamba": (0, 1, 2),
    "2pool:full+full8|mamba8": (0, 0, 1),
    "2pool:full8|swa4+chunked": (0, 1, 1),
}


def mix_pools(mix: str) -> tuple[int, ...]:
    return MIX_POOLS.get(mix, (0,) * len(MIXES[mix]))


def num_pools(mix: str) -> int:
    return max(mix_pools(mix)) + 1


@dataclass(frozen=True)
class SimConfig:
    mix: str
    num_blocks: int | tuple[int, ...]  # an int: that many blocks in every pool
    enable_caching: bool = True
    retention: RetentionOptions = RetentionOptions()
    enable_events: bool = True
    vocab: int = 4
    seed: int = 0  # base sequences (shared prompt prefixes)

    @property
    def groups(self) -> list[KVCacheGroup]:
        return [KVCacheGroup(spec, pool=p) for spec, p in zip(MIXES[self.mix], mix_pools(self.mix))]

    @property
    def pool_sizes(self) -> tuple[int, ...]:
        if isinstance(self.num_blocks, int):
            return (self.num_blocks,) * num_pools(self.mix)
        return self.num_blocks

    def describe(self) -> str:
        r = self.retention
        ret = f"retention(budget={r.budget_blocks}, swa={r.pin_sliding_window}, min_drop={r.min_drop_blocks})"
        return (
            f"SimConfig(mix={self.mix!r}, num_blocks={self.num_blocks}, enable_caching={self.enable_caching}, "
            f"{ret if r.enabled else 'no retention'}, events={self.enable_events}, vocab={self.vocab}, seed={self.seed})"
        )


def _blocks_alone(specs: tuple, length: int) -> int:
    """Worst-case blocks one request of ``length`` tokens holds alone (a chunk may span it all)."""
    total = 0
    for spec in specs:
        total += 3 if isinstance(spec, MambaSpec) else cdiv(length, spec.block_size)
    return total


def _pool_specs(mix: str) -> list[tuple]:
    """The specs of each pool of a mix, in pool order."""
    pools = mix_pools(mix)
    return [tuple(s for s, q in zip(MIXES[mix], pools) if q == p) for p in range(num_pools(mix))]


def max_len_for(mix: str, num_blocks: int | tuple[int, ...]) -> int:
    """Longest request (prompt + output) that fits every pool alone, capped at MAX_LEN_CAP."""
    per_pool = _pool_specs(mix)
    sizes = (num_blocks,) * len(per_pool) if isinstance(num_blocks, int) else num_blocks
    length = 1
    while length < MAX_LEN_CAP and all(
        _blocks_alone(specs, length + 1) <= n - 1 for specs, n in zip(per_pool, sizes)
    ):
        length += 1
    return length


def min_pool_blocks_for(mix: str) -> tuple[int, ...]:
    """Per pool, the smallest size in which one request can reach a few alignment units."""
    groups = [KVCacheGroup(s) for s in MIXES[mix]]
    length = 3 * alignment_tokens(groups) + 1
    return tuple(_blocks_alone(specs, length) + 1 for specs in _pool_specs(mix))


def min_blocks_for(mix: str) -> int:
    """Smallest size that fits every pool of the mix (see ``min_pool_blocks_for``)."""
    return max(min_pool_blocks_for(mix))


def random_pool_sizes(rng: random.Random, mix: str) -> tuple[int, ...]:
    """Pools of different sizes, each at least what one request needs alone."""
    return tuple(rng.randint(max(4, low), max(4, low) + rng.choice([0, 4, 16, 40])) for low in min_pool_blocks_for(mix))


def random_config(rng: random.Random, mixes: list[str] | None = None) -> SimConfig:
    """A random configuration over ``mixes`` (default: every mix); several pools get random,
    different-sized pools."""
    mix = rng.choice(sorted(mixes or MIXES))
    num_blocks: int | tuple[int, ...]
    if num_pools(mix) > 1:
        num_blocks = random_pool_sizes(rng, mix)
    else:
        low = max(12, min_blocks_for(mix))
        num_blocks = rng.randint(low, max(low, 64))
    retention = RetentionOptions()
    if rng.random() < 0.5:
        retention = RetentionOptions(
            enabled=True,
            budget_blocks=rng.choice([None, 1, 2, 4, 8]),
            pin_sliding_window=rng.random() < 0.85,
            min_drop_blocks=rng.choice([1, 1, 2]),
        )
    return SimConfig(
        mix=mix,
        num_blocks=num_blocks,
        enable_caching=rng.random() < 0.93,
        retention=retention,
        enable_events=rng.random() < 0.9,
        vocab=rng.choice([2, 3, 4, 4]),
        seed=rng.randrange(1 << 30),
    )


# -- requests ---------------------------------------------------------------------------------------------
@dataclass(eq=False)
class SimRequest:
    req: CacheRequest
    max_tokens: int
    state: str = WAITING
    generated: int = 0
    order: int = 0  # admission order (FCFS preemption picks the newest)
    load: tuple[int, int] | None = None  # (local hit, hit + external) while LOADING
    preemptions: int = 0

    @property
    def rid(self) -> str:
        return self.req.request_id


@dataclass
class Snapshot:
    refs: list[list[int]]  # per pool, per block id
    cached: list[dict[bytes, int]]  # per group
    tables: dict[str, list[list[int]]]
    admitted: set[str]


@dataclass
class PinRecord:
    hashes: list[bytes]
    num_tokens: int
    pinned: int


# -- the simulator -------------------------------------------------------------------------------------------
@dataclass
class Sim:
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

    def _prefix_key(self, req: CacheRequest, n: int) -> tuple | None:
        """Identity of ``req.token_ids[:n]`` (None if the request has fewer tokens)."""
        if n > req.num_tokens or n < 0:
            return None
        hbs = req.hash_block_size
        full = n // hbs
        if full and full * hbs == n:
            return ("H", req.block_hashes[full - 1])
        parent = req.block_hashes[full - 1] if full else None
        return ("P", req.cache_salt, parent, tuple(req.token_ids[full * hbs : n]))

    @staticmethod
    def needed_blocks(m: SingleTypeManager, length: int) -> range:
        """Table indices whose cached blocks a hit at ``length`` needs (independent of the engine)."""
        bs = m.block_size
        end = length // bs
        if isinstance(m, FullAttentionManager):
            return range(end)
        if isinstance(m, SlidingWindowManager):
            need = cdiv(m.spec.window - 1, bs)
            return range(max(0, end - need), end)
        if isinstance(m, ChunkedLocalManager):
            chunk = m.spec.chunk_size
            return range(((length // chunk) * chunk) // bs, end)
        if isinstance(m, MambaManager):
            return range(end - 1, end) if end else range(0)
        raise TypeError(type(m))

    def oracle_hit(self, hashes: list[bytes], max_length: int, skip_mamba: bool) -> int:
        """Largest aligned L <= max_length at which every (participating) group's rule holds."""
        if not self.cfg.enable_caching or max_length <= 0:
            return 0
        groups = [
            (g, m, m.view(hashes))
            for g, m in enumerate(self.managers)
            if not (skip_mamba and isinstance(m, MambaManager))
        ]
        align = self.alignment
        for length in range(max_length - max_length % align, 0, -align):
            ok = True
            for g, m, view in groups:
                cached = m.cached
                mine = all(view[i] in cached for i in self.needed_blocks(m, length))
                if mine != m.hit_valid(view, length):
                    self.fail(f"group {g} hit_valid({length}) = {not mine} but the rule says {mine}")
                if not mine:
                    ok = False
                    break
            if ok:
                return length
        return 0

    def check_hit(self, req: CacheRequest, hit: CacheHit, max_length: int, skip_mamba: bool, what: str) -> None:
        length = hit.num_tokens
        if length < 0 or length % self.alignment or length > max(max_length, 0):
            self.fail(f"{what} {req.request_id}: hit {length} not aligned to {self.alignment} or > {max_length}")
        expected = self.oracle_hit(req.block_hashes, max_length, skip_mamba)
        if length != expected:
            self.fail(f"{what} {req.request_id}: hit {length} tokens but the oracle says {expected} (max {max_length})")
        if self.cfg.enable_caching and self.has_mamba and hit.partial != skip_mamba:
            self.fail(f"{what}: partial={hit.partial} for skip_mamba={skip_mamba}")
        if length and hit.shared_prefix_tokens < length:
            self.fail(f"{what}: shared_prefix_tokens {hit.shared_prefix_tokens} < hit {length}")
        for g, m in enumerate(self.managers):
            null = self.pools[self.group_pool[g]].null_block
            blocks = hit.blocks[g]
            if skip_mamba and isinstance(m, MambaManager):
                if blocks:
                    self.fail(f"{what}: skipped Mamba group {g} returned blocks")
                continue
            if len(blocks) != length // m.block_size:
                self.fail(f"{what}: group {g} list has {len(blocks)} blocks for a hit of {length}")
            view = m.view(req.block_hashes)
            needed = self.needed_blocks(m, length)
            for i, block in enumerate(blocks):
                if i in needed:
                    if block is null or block.block_hash != view[i] or m.cached.get(view[i]) is not block:
                        self.fail(f"{what}: group {g} index {i} of the hit is {block!r}, not the cached block")
                elif block is not null:
                    self.fail(f"{what}: group {g} index {i} outside the needed range holds {block!r}")

    # -- data model --------------------------------------------------------------------------------------
    def _read(self, req: CacheRequest, g: int, table: list, j: int, lo: int, hi: int, what: str) -> None:
        """Positions [lo, hi) of table index j must hold ``req``'s own KV."""
        bs = self.managers[g].block_size
        if j >= len(table) or table[j].is_null:
            self.fail(f"{what}: {req.request_id} group {g} reads positions {lo}..{hi} but index {j} is null/missing")
        bid = table[j].block_id
        content = self.content.get(self.key(table[j]))
        if content is None:
            self.fail(f"{what}: {req.request_id} group {g} reads block {bid} (index {j}) that was never written")
        group, first, end, key = content
        if group != g or not (j * bs < end <= (j + 1) * bs) or first > lo or end < hi or self._prefix_key(req, end) != key:
            self.fail(
                f"{what}: {req.request_id} group {g} index {j} block {bid} holds positions [{first}, {end}) of "
                f"another prefix / range, needs [{lo}, {hi}) of its own"
            )

    def _write(self, req: CacheRequest, g: int, table: list, j: int, lo: int, hi: int, what: str) -> None:
        bs = self.managers[g].block_size
        if j >= len(table) or table[j].is_null:
            self.fail(f"{what}: {req.request_id} group {g} writes positions {lo}..{hi} but index {j} is null/missing")
        block = table[j]
        old = self.content.get(self.key(block))
        first = lo
        end = hi
        if old is not None:
            o_group, o_first, o_end, o_key = old
            if (
                o_group == g
                and j * bs < o_end <= (j + 1) * bs
                and o_first <= lo <= o_end
                and self._prefix_key(req, o_end) == o_key
            ):
                first = o_first
                end = max(o_end, hi)
        new = (g, first, end, self._prefix_key(req, end))
        if new != old and self._sealed(block):
            self.fail(f"{what}: {req.request_id} group {g} writes into cached block {block!r} at index {j}")
        self.content[self.key(block)] = new

    @staticmethod
    def key(block) -> tuple[int, int]:
        """A block's identity across pools: (pool, block id)."""
        return block.pool, block.block_id

    def effective(self, bid: tuple[int, int]) -> tuple | None:
        """Contents once the current step's forward has finished (pending Mamba states included)."""
        pending = self.pending.get(bid)
        return pending[1] if pending is not None else self.content.get(bid)

    def commit(self, rid: str | None = None) -> None:
        """The forward finished (for ``rid``, or for everyone): pending Mamba states land."""
        for bid, (owner, content) in list(self.pending.items()):
            if rid is None or owner == rid:
                self.content[bid] = content
                del self.pending[bid]

    def _write_state(
        self, req: CacheRequest, g: int, table: list, length: int, what: str, deferred: bool = True
    ) -> None:
        bs = self.managers[g].block_size
        j = cdiv(length, bs) - 1
        if j >= len(table) or table[j].is_null:
            self.fail(f"{what}: {req.request_id} Mamba group {g} has no state block at index {j} for {length} tokens")
        block = table[j]
        key = self.key(block)
        new = (g, length, length, self._prefix_key(req, length))
        if self.effective(key) != new and self._sealed(block):
            self.fail(f"{what}: {req.request_id} Mamba group {g} overwrites cached state block {block!r}")
        if deferred:
            self.pending[key] = (req.request_id, new)
        else:
            self.pending.pop(key, None)
            self.content[key] = new

    def _sealed(self, block) -> bool:
        """A block whose contents must not change: cached before this operation's allocation and not
        handed out again since (eager caching hashes blocks just before their KV is written)."""
        key = self.key(block)
        return block.block_hash is not None and key in self.hashed_before and key not in self.fresh

    def _read_state(self, req: CacheRequest, g: int, table: list, length: int, what: str) -> None:
        bs = self.managers[g].block_size
        j = cdiv(length, bs) - 1
        if j >= len(table) or table[j].is_null:
            self.fail(f"{what}: {req.request_id} Mamba group {g} lost the state after {length} tokens (index {j})")
        bid = table[j].block_id
        if self.key(table[j]) in self.pending:
            self.fail(f"{what}: {req.request_id} Mamba group {g} reads block {bid}, whose state is written only at the end of this step")
        content = self.content.get(self.key(table[j]))
        if content is None or content[:3] != (g, length, length) or content[3] != self._prefix_key(req, length):
            self.fail(
                f"{what}: {req.request_id} Mamba group {g} index {j} block {table[j].block_id} holds state "
                f"{content[:3] if content else None}, needs the state after its own {length} tokens"
            )

    def compute(self, r: SimRequest, start: int, end: int, what: str) -> None:
        """The forward pass of tokens [start, end): read what they attend to, write their KV/state."""
        if not self.data_model:
            return
        req = r.req
        rid = r.rid
        for g, m in enumerate(self.managers):
            table = m.tables[rid]
            bs = m.block_size
            if isinstance(m, MambaManager):
                if start:
                    self._read_state(req, g, table, start, what)
                self._write_state(req, g, table, end, what)
                continue
            if isinstance(m, SlidingWindowManager):
                lo = max(0, start - m.spec.window + 1)
            elif isinstance(m, ChunkedLocalManager):
                lo = (start // m.spec.chunk_size) * m.spec.chunk_size
            else:
                lo = 0
            for j in range(lo // bs, cdiv(start, bs)):
                self._read(req, g, table, j, max(lo, j * bs), min(start, (j + 1) * bs), what)
            for j in range(start // bs, cdiv(end, bs)):
                self._write(req, g, table, j, max(start, j * bs), min(end, (j + 1) * bs), what)

    def load(self, r: SimRequest, start: int, end: int, what: str) -> None:
        """External KV for tokens [start, end) lands (only where the table has real blocks); Mamba
        groups receive the state after ``end`` tokens."""
        if not self.data_model:
            return
        req = r.req
        for g, m in enumerate(self.managers):
            table = m.tables[r.rid]
            if isinstance(m, MambaManager):
                if end > 0:
                    self._write_state(req, g, table, end, what, deferred=False)
                continue
            bs = m.block_size
            for j in range(start // bs, cdiv(end, bs)):
                if j < len(table) and not table[j].is_null:
                    self._write(req, g, table, j, max(start, j * bs), min(end, (j + 1) * bs), what)

    # -- snapshots for failed allocations --------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return Snapshot(
            refs=[[b.ref_cnt for b in pool.blocks] for pool in self.pools],
            cached=[{h: b.block_id for h, b in m.cached.items()} for m in self.managers],
            tables={rid: self.coord.block_ids(rid) for rid in self.coord.requests},
            admitted=set(self.coord.requests),
        )

    def check_unchanged(self, rid: str, before: Snapshot, computed: int) -> None:
        """A failed allocate_slots: only window drops of ``rid`` (slots before its skipped range at
        ``computed`` tokens becoming null) may have happened."""
        after = self.snapshot()
        if after.admitted != before.admitted:
            self.fail(f"failed allocation for {rid} changed the admitted set")
        if after.cached != before.cached:
            self.fail(f"failed allocation for {rid} changed the prefix-cache maps")
        null_id = self.coord.null_block_id
        released: Counter[tuple[int, int]] = Counter()  # (pool, block id)
        for other, tables in before.tables.items():
            now = after.tables[other]
            if other != rid:
                if now != tables:
                    self.fail(f"failed allocation for {rid} changed the table of {other}")
                continue
            for g, (old, new) in enumerate(zip(tables, now)):
                if len(old) != len(new):
                    self.fail(f"failed allocation for {rid} resized its group {g} table")
                spec = self.managers[g].spec
                skipped = spec.skipped_tokens(computed) // spec.block_size
                for i, (a, b) in enumerate(zip(old, new)):
                    if a != b:
                        if b != null_id or i >= skipped:
                            self.fail(f"failed allocation for {rid} replaced group {g} index {i}: {a} -> {b}")
                        released[(self.group_pool[g], a)] += 1
        for p, (refs_before, refs_after) in enumerate(zip(before.refs, after.refs)):
            for bid, (a, b) in enumerate(zip(refs_before, refs_after)):
                if bid == null_id:
                    continue
                if a - b != released.get((p, bid), 0):
                    self.fail(
                        f"failed allocation for {rid}: block {bid} of pool {p} ref {a} -> {b}, "
                        f"released {released.get((p, bid), 0)}"
                    )

    def _mamba_deferred(self, hit: CacheHit | None) -> bool:
        if hit is None:
            return False
        for g, m in enumerate(self.managers):
            if isinstance(m, MambaManager) and hit.blocks[g] and hit.blocks[g][-1].block_hash in m.cached_this_step:
                return True
        return False

    def allocate(
        self,
        r: SimRequest,
        num_new: int,
        hit: CacheHit | None = None,
        ext: int = 0,
        delay: bool = False,
        reserved: int = 0,
    ) -> list[list[int]] | None:
        req = r.req
        before = self.snapshot()
        self.hashed_before = {(self.group_pool[g], bid) for g, table in enumerate(before.cached) for bid in table.values()}
        deferred = self._mamba_deferred(hit)
        ids = self.coord.allocate_slots(
            req, num_new, hit=hit, num_external_tokens=ext, delay_cache=delay, reserved_blocks=reserved
        )
        self.note(
            f"allocate_slots({r.rid}, new={num_new}, hit={hit.num_tokens if hit else None}, ext={ext}, "
            f"delay={delay}, reserved={reserved}) -> {'None' if ids is None else 'ok'}"
        )
        if ids is None:
            self.tag("alloc_fail")
            if deferred:
                self.tag("mamba_same_step_defer")
            self.check_unchanged(r.rid, before, req.num_computed_tokens)
            need = req.num_computed_tokens + (hit.num_tokens if hit else 0) + ext + num_new
            bound = [0] * len(self.pools)
            for g, m in enumerate(self.managers):
                bound[self.group_pool[g]] += 3 if isinstance(m, MambaManager) else cdiv(need, m.block_size)
            free = [pool.num_free_blocks for pool in self.pools]
            if not deferred and all(f - reserved >= n for f, n in zip(free, bound)):
                self.fail(
                    f"allocate_slots({r.rid}, {num_new}) failed with {free} free blocks per pool, "
                    f"reserved {reserved}, while at most {bound} are needed"
                )
            self.check()
        return ids

    # ------------------------------------------------------------------------------------------------
    # checks after every operation
    def check(self) -> None:
        self.fresh.clear()
        self.hashed_before = set()
        self.coord.check_invariants()
        if self.cfg.enable_events:
            for event in self.coord.take_events():
                if event.seq != self.last_seq + 1:
                    self.fail(f"event sequence gap: {self.last_seq} -> {event.seq}")
                self.last_seq = event.seq
                if not isinstance(event, AllBlocksCleared) and event.pool != self.group_pool[event.group]:
                    self.fail(f"{type(event).__name__} of group {event.group} names pool {event.pool}")
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        key = (event.group, h)
                        if key in self.stored:
                            # The pool moved the entry to a fresher copy of the same content; the
                            # hash stays hittable, so a set-based index is unaffected.
                            self.tag("stored_again")
                        self.stored.add(key)
                elif isinstance(event, BlockRemoved):
                    self.tag("evicted")
                    for h in event.block_hashes:
                        key = (event.group, h)
                        if key not in self.stored:
                            self.fail(f"BlockRemoved for a hash never stored in group {event.group}")
                        if key in self.pinned:
                            self.fail(f"BlockRemoved for a pinned hash in group {event.group}")
                        self.stored.discard(key)
                elif isinstance(event, BlockPinned):
                    level = 2 if event.explicit else 1
                    self.tag("pinned_explicit" if event.explicit else "pinned_retained")
                    for h in event.block_hashes:
                        key = (event.group, h)
                        if key not in self.stored or self.pinned.get(key, 0) >= level:
                            self.fail(f"BlockPinned(explicit={event.explicit}) for an unstored or already pinned hash")
                        self.pinned[key] = level
                elif isinstance(event, BlockUnpinned):
                    for h in event.block_hashes:
                        key = (event.group, h)
                        if key not in self.pinned:
                            self.fail(f"BlockUnpinned for a hash that is not pinned (group {event.group})")
                        del self.pinned[key]
                elif isinstance(event, AllBlocksCleared):
                    self.stored.clear()
                    self.pinned.clear()
            actual = {(g, h) for g, m in enumerate(self.managers) for h in m.cached}
            if actual != self.stored:
                self.fail(
                    f"event replay disagrees with the pool: {len(actual - self.stored)} cached but not announced, "
                    f"{len(self.stored - actual)} announced but not cached"
                )
            pins = {(b.group, b.block_hash): b.pin for pool in self.pools for b in pool.blocks if b.pin != PIN_NONE}
            if pins != self.pinned:
                self.fail(f"event replay disagrees with pin levels: {len(pins)} pinned vs {len(self.pinned)} announced")
        if self.data_model:
            for g, m in enumerate(self.managers):
                for h, block in m.cached.items():
                    content = self.effective(self.key(block))
                    bs = self.managers[g].block_size
                    if (
                        content is None
                        or content[0] != g
                        or content[3] != ("H", h)
                        or (not isinstance(self.managers[g], MambaManager) and content[1] % bs)
                    ):
                        self.fail(f"cached block {block!r} of group {g} holds {content and content[:3]}, not its hash")
        for r in self.live(LOADING):
            local, _ = r.load  # type: ignore[misc]
            for g, m in enumerate(self.managers):
                table = m.tables[r.rid]
                for j in range(local // m.block_size, len(table)):
                    b = table[j]
                    if not b.is_null and (b.block_hash is not None or b.ref_cnt != 1):
                        self.fail(f"{r.rid} waits for KV but its group {g} index {j} block is {b!r}")
        admitted = {r.rid for r in self.reqs.values() if r.state in (RUNNING, LOADING)}
        if set(self.coord.requests) != admitted:
            self.fail(f"coordinator admits {sorted(self.coord.requests)}, simulator {sorted(admitted)}")
        for p, pool in enumerate(self.pools):
            if not 0 <= pool.num_free_blocks <= pool.num_blocks - 1:
                self.fail(f"pool {p}: num_free_blocks {pool.num_free_blocks} out of range")
            if self.coord.num_free_blocks_in(p) != pool.num_free_blocks:
                self.fail(f"num_free_blocks_in({p}) disagrees with the pool")
        tight = max(range(len(self.pools)), key=lambda p: (self.pools[p].usage, -p))
        if self.coord.num_free_blocks != self.pools[tight].num_free_blocks or self.coord.usage != self.pools[tight].usage:
            self.fail("num_free_blocks/usage do not describe the tightest pool")

    def free_request(self, rid: str) -> None:
        """coord.free, then invariant 16: within each group, the request's blocks that went to the free
        queue are ordered uncached first, then cached ones chain tail first (higher index earlier)."""
        self.commit(rid)  # frees are processed once the request's forward has finished
        tables = [list(m.tables.get(rid, ())) for m in self.managers]
        # Explicitly pinned blocks go to their tier. (With retention, freeing may also pin blocks
        # and demote others to the tail over budget: the order is then a retention policy.)
        pinned = {self.key(b) for table in tables for b in table if b.pin}
        self.coord.free(rid)
        if not any(tables) or self.cfg.retention.enabled:
            return
        for g, table in enumerate(tables):
            pool = self.pools[self.group_pool[g]]
            position = {b.block_id: i for i, b in enumerate(pool.free_queue)}
            freed = [
                (j, b)
                for j, b in enumerate(table)
                if not b.is_null and b.block_id in position and self.key(b) not in pinned
            ]
            cached = [position[b.block_id] for j, b in sorted(freed, key=lambda jb: -jb[0]) if b.block_hash is not None]
            uncached = [position[b.block_id] for _, b in freed if b.block_hash is None]
            if cached != sorted(cached) or (cached and uncached and max(uncached) > cached[0]):
                self.fail(f"free({rid}) group {g}: free-queue order of the released blocks is not tail first")

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

    def advance(self, index: int, chunk: int = 1 << 20, aligned: bool = True, reserved: int = 0, policy: int = 0) -> str:
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

    def pin(self, source: int, length: int) -> str:
        reqs = [r.req for r in self.reqs.values()] + [r.req for r in self.finished]
        if not reqs:
            return "pin_none"
        req = reqs[source % len(reqs)]
        hashes = list(req.block_hashes)
        n = 1 + length % req.num_tokens
        pinned = self.coord.pin_prefix(hashes, n)
        self.note(f"pin_prefix({req.request_id}, {n}) -> {pinned}")
        expected = self.oracle_hit(hashes, n, False)
        if pinned != expected:
            self.fail(f"pin_prefix({req.request_id}, {n}) pinned {pinned} tokens, the oracle hit is {expected}")
        if pinned:
            for g, m in enumerate(self.managers):
                view = m.view(hashes)
                for i in self.needed_blocks(m, pinned):
                    block = m.cached.get(view[i])
                    if block is None or block.pin != PIN_EXPLICIT:
                        self.fail(f"pin_prefix({n}) -> {pinned}: group {g} index {i} is {block!r}, not pinned")
            self.tag("pin")
        else:
            self.tag("pin_nothing")
        self.pins.append(PinRecord(hashes, n, pinned))
        self.held[self.pin_key(hashes, n)] += 1  # every call counts, even one that pinned nothing
        self.check()
        return "pin" if pinned else "pin_nothing"

    def pin_key(self, hashes: list[bytes], n: int) -> tuple:
        """Pins with the same token count over the same chain of full hash blocks are the same prefix."""
        full = min(n // self.coord.hash_block_size, len(hashes))
        return (n, hashes[full - 1] if full else b"")

    def unpin(self, index: int) -> str:
        if not self.pins:
            return "unpin_none"
        rec = self.pins.pop(index % len(self.pins))
        # The documented undo: the same arguments as the pin_prefix call.
        key = self.pin_key(rec.hashes, rec.num_tokens)
        # Pins of one prefix are counted; its blocks are released with the last unpin.
        expected = self.held[key] > 0
        if expected:
            self.held[key] -= 1
        held = self.coord.unpin_prefix(rec.hashes, rec.num_tokens)
        self.note(f"unpin_prefix(n={rec.num_tokens}) -> {held} (pinned {rec.pinned})")
        if held is not None and held != expected:
            self.fail(f"unpin_prefix(n={rec.num_tokens}) returned {held}, {expected} pins of that prefix are held")
        self.tag("unpin" if rec.pinned else "unpin_nothing")
        self.check()
        return "unpin"

    def reset(self) -> str:
        idle = all(pool.num_free_blocks == pool.num_blocks - 1 for pool in self.pools)
        ok = self.coord.reset_prefix_cache()
        self.note(f"reset_prefix_cache -> {ok}")
        if ok != idle:
            self.fail(f"reset_prefix_cache() returned {ok} with idle={idle}")
        if ok:
            if any(m.cached for m in self.managers) or any(
                b.block_hash is not None or b.pin for pool in self.pools for b in pool.blocks
            ):
                self.fail("reset_prefix_cache left hashes or pins behind")
            self.pins.clear()
            self.held.clear()
            self.tag("reset")
        self.check()
        return "reset" if ok else "reset_refused"

    def drain(self) -> str:
        """Abort everything, release every explicit pin: the pool must be whole again."""
        for r in list(self.reqs.values()):
            self.finish(r, "abort")
            self.check()
        while self.pins:
            self.unpin(0)
        for p, pool in enumerate(self.pools):
            if pool.num_free_blocks != pool.num_blocks - 1:
                self.fail(f"after draining pool {p} has {pool.num_free_blocks} free blocks, expected {pool.num_blocks - 1}")
            if any(b.ref_cnt for b in pool.blocks if not b.is_null):
                self.fail(f"after draining some block of pool {p} is still referenced")
        left = [b for pool in self.pools for b in pool.blocks if b.pin == PIN_EXPLICIT]
        explicit = sum(pool.explicit.size for pool in self.pools)
        # The coordinator's private pin bookkeeping, where it has any, must be empty too.
        books = {name: len(getattr(self.coord, name, ())) for name in ("_explicit_pins", "_prefix_pins")}
        if left or explicit or any(books.values()):
            self.fail(
                f"after unpinning every pin: {len(left)} blocks still explicitly pinned, explicit tiers "
                f"{explicit}, pin bookkeeping {books}"
            )
        self.commit()
        self.scheduled.clear()
        self.preempted_this_step = False
        self.coord.new_step()
        self.check()
        self.tag("drain")
        return "drain"


# -- random driver (shared by the fuzzer and the composite hypothesis rule) ------------------------------------------
OPS: dict[str, int] = {
    "arrive": 12,
    "admit": 16,
    "advance": 30,
    "end_step": 12,
    "complete_load": 5,
    "abort": 3,
    "remove_skipped": 3,
    "pin": 3,
    "unpin": 2,
    "reset": 1,
}


class RandomDriver:
    """Draws operations and their arguments from a ``random.Random``."""

    def __init__(self, sim: Sim, rng: random.Random, ops: dict[str, int] | None = None):
        self.sim = sim
        self.rng = rng
        weights = ops or OPS
        self.kinds = list(weights)
        self.cum: list[int] = []
        total = 0
        for kind in self.kinds:
            total += weights[kind]
            self.cum.append(total)
        self.table: dict[str, Callable[[], str]] = {
            "arrive": self.arrive,
            "admit": self.admit,
            "advance": self.advance,
            "end_step": lambda: sim.end_step(rng.randrange(1 << 16)),
            "complete_load": lambda: sim.complete_load(rng.randrange(64), rng.choice([0, 0, 0, 0, 1, 2]), rng.randrange(128)),
            "abort": lambda: sim.abort(rng.randrange(64), rng.random() < 0.2),
            "remove_skipped": lambda: sim.remove_skipped(rng.randrange(64), rng.choice([0, 0, 1, 3])),
            "pin": lambda: sim.pin(rng.randrange(64), rng.randrange(128)),
            "unpin": lambda: sim.unpin(rng.randrange(64)),
            "reset": sim.reset,
            "drain": sim.drain,
        }

    def chunk(self) -> int:
        rng = self.rng
        x = rng.random()
        if x < 0.4:
            return 1 << 20
        if x < 0.7:
            return rng.randint(1, 8)
        return rng.randint(1, 40)

    def arrive(self) -> str:
        rng = self.rng
        sim = self.sim
        return sim.arrive(
            source=rng.randrange(64),
            cut=rng.randrange(sim.max_len + 1),
            suffix=[rng.randrange(sim.cfg.vocab) for _ in range(rng.choice([0, 0, 1, 2, 5, 9]))],
            max_tokens=rng.choice([1, 2, 4, 8, 16]),
            remote=rng.random() < 0.2,
            salt=None if rng.random() < 0.85 else "s",
        )

    def admit(self) -> str:
        rng = self.rng
        return self.sim.admit(
            rng.randrange(64),
            ext=0 if rng.random() < 0.6 else rng.randint(1, 40),
            chunk=self.chunk(),
            async_load=rng.random() < 0.6,
            aligned=rng.random() < 0.5,
            reserved=0 if rng.random() < 0.85 else rng.randint(1, 4),
            relookup=rng.random() < 0.5,
        )

    def advance(self) -> str:
        rng = self.rng
        return self.sim.advance(
            rng.randrange(64),
            chunk=self.chunk(),
            aligned=rng.random() < 0.5,
            reserved=0 if rng.random() < 0.9 else rng.randint(1, 3),
            policy=rng.randrange(6),
        )

    def pick(self) -> str:
        x = self.rng.randrange(self.cum[-1])
        for kind, c in zip(self.kinds, self.cum):
            if x < c:
                return kind
        return self.kinds[-1]

    def step(self, kind: str | None = None) -> tuple[str, str]:
        """One operation: returns (kind, outcome)."""
        kind = kind or self.pick()
        self.sim.op_index += 1
        return kind, self.table[kind]()

    def scheduler_step(self) -> list[str]:
        """A whole scheduler step the vLLM way: arrivals, running requests first (preempting on
        failure), then admissions until one fails, load completions, then outputs."""
        rng = self.rng
        sim = self.sim
        outcomes = []
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            outcomes.append(self.arrive())
        for _ in range(len(sim.live(RUNNING))):
            outcomes.append(self.advance())
        for _ in range(len(sim.live(WAITING))):
            out = self.admit()
            outcomes.append(out)
            if out in ("admit_fail", "admit_blocked", "admit_none"):
                break
        for _ in range(len(sim.live(LOADING))):
            if rng.random() < 0.5:
                outcomes.append(sim.complete_load(rng.randrange(64), rng.choice([0, 0, 0, 1, 2]), rng.randrange(128)))
        if rng.random() < 0.1:
            outcomes.append(sim.pin(rng.randrange(64), rng.randrange(128)))
        if rng.random() < 0.07:
            outcomes.append(sim.unpin(rng.randrange(64)))
        outcomes.append(sim.end_step(rng.randrange(1 << 16)))
        return outcomes
