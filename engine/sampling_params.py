"""Per-request sampling and stopping parameters (pure data; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters;
    ``seed`` makes a sampled request reproducible on its own, independent of batching.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1 (got {self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1] (got {self.top_p})")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise ValueError(f"stop: stop strings must be non-empty (got {self.stop!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
