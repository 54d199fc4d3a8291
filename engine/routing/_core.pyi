"""Types of the compiled holder maps (``_core.c``); ``holder_maps.HolderMaps`` documents them."""

from collections.abc import Hashable, Iterable, Sequence
from typing import final

from engine.kv_cache.events import BlockPinned, BlockRemoved, BlockStored, KVEvent

@final
class HolderMaps:
    def __init__(self, num_groups: int) -> None: ...
    def add_slot(self, slot: int) -> None: ...
    def release_slot(self, slot: int) -> None: ...
    def clear(self, slot: int) -> None: ...
    def compact(self, slot: int) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def num_cached(self, slot: int) -> int: ...
    def listed(self, slot: int) -> int: ...
    def store(self, group: int, keys: Sequence[bytes], slot: int, /) -> None: ...
    def hold(self, group: int, entries: Iterable[tuple[bytes, int]], slot: int, /) -> None: ...
    def remove(self, group: int, keys: Sequence[bytes], slot: int, report: bool, /) -> list[bytes] | None: ...
    def relevel(
        self, group: int, keys: Sequence[bytes], slot: int, level: int, raise_only: bool, report: bool, /
    ) -> list[bytes] | None: ...
    def level(self, group: int, key: bytes, slot: int, /) -> int | None: ...
    def holders(self, group: int, key: bytes, /) -> list[int]: ...
    def table(self, group: int, slot: int, /) -> dict[bytes, int]: ...
    def size(self, group: int) -> int: ...
    def met(self, group: int, keys: Sequence[bytes], /) -> set[int]: ...
    def walk(
        self,
        first: int,
        hashes: list[bytes],
        factor: int,
        limit: int,
        per: int,
        checks: list[tuple[int, int, list[tuple[int, int]]]],
        /,
    ) -> list[tuple[int, list[int], list[int]]]: ...
    def predict(
        self,
        first: int,
        hashes: list[bytes],
        factor: int,
        limit: int,
        per: int,
        checks: list[tuple[int, int, list[tuple[int, int]]]],
        align: int,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        /,
    ) -> tuple[list[Hashable], int, int]: ...
    def predict_tiered(
        self,
        first: int,
        hashes: list[bytes],
        factor: int,
        limit: int,
        per: int,
        checks: list[tuple[int, int, list[tuple[int, int]]]],
        align: int,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        order: list[tuple[int, int, list[tuple[int, int]]]],
        host: HolderMaps,
        counts: dict[int, int],
        steps: int,
        unit: int,
        prefix: bool,
        host_hits: dict[Hashable, int] | None,
        /,
    ) -> tuple[set[Hashable] | None, int, int]: ...
    def tiered(
        self,
        hashes: list[bytes],
        order: list[tuple[int, int, list[tuple[int, int]]]],
        host: HolderMaps,
        steps: int,
        align: int,
        unit: int,
        prefix: bool,
        ids: list[Hashable],
        hits: dict[Hashable, int],
        shared: dict[Hashable, int] | None,
        host_hits: dict[Hashable, int] | None,
        pending: set[Hashable] | None,
        extra: list[int],
        /,
    ) -> int: ...
    def absorb(
        self,
        events: list[KVEvent],
        start: int,
        slot: int,
        last_seq: int,
        kinds: tuple[type[BlockStored], type[BlockRemoved], type[BlockPinned]],
        /,
    ) -> tuple[int, int]: ...
