"""What the driver API hands back for a request: the finished ``ClusterCompletion`` and the
``Delta`` each arrival of streamed tokens adds. Plain frozen records, shared by the request
runner that builds them, the in-flight table that awaits them and the API that returns them."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.completion import Completion
from engine.logprobs import TokenLogprob


@dataclass(frozen=True)
class ClusterCompletion(Completion):
    """A finished request with where it ran: the router's predicted prefix hit and the hit the
    worker that prefilled it actually found (``cached_tokens``), driver-side timings and the
    TTFT's breakdown per hop (``hops``, see ``actors.hops``). A request that migrated
    (``migrations`` > 0) names the workers and the routing of its last attempt, and the hit,
    TTFT and hops of the attempt that produced its first token."""

    request_id: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    prefill_worker: str = ""
    decode_worker: str = ""
    route_reason: str = ""
    predicted_hit: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    hops: dict[str, float] = field(default_factory=dict)  # TTFT per hop, s (actors.hops)
    # one per token of ``token_ids`` when the sampling asked for ``logprobs`` (engine.logprobs)
    logprobs: list[TokenLogprob] | None = None
    # one per prompt token (None for the first) when it asked for ``prompt_logprobs``
    prompt_logprobs: list[TokenLogprob | None] | None = None
    migrations: int = 0  # times the request moved to another worker after streaming tokens

    @property
    def disaggregated(self) -> bool:
        return self.prefill_worker != self.decode_worker


@dataclass(frozen=True)
class Delta:
    """Text a request gained (``num_tokens`` new output tokens), as streamed to a client, with
    those tokens' ids and (when the sampling asked for them) their logprobs."""

    text: str
    num_tokens: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
