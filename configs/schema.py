"""The one cluster configuration schema: pydantic v2 models, frozen, unknown fields rejected.

The same ``ClusterConfig`` serves the driver API, the CLI, the ``ray job submit`` entrypoint and
the Kubernetes ConfigMap. Defaults equal the embedded ``local`` preset (1 prefill + 1 decode
worker running Gemma-3-270M on this machine). Derived values are properties; nothing here is
mutated after construction (use ``model_copy(update=...)`` for per-replica copies).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from configs.models import SourceKind, classify_source

CROSS_FIELD_ERROR = "kvfleet_cross_field"


def cross_field_error(path: str, message: str, value: Any) -> PydanticCustomError:
    """An error for a check that spans fields; ``path`` is relative to the validating model."""
    return PydanticCustomError(CROSS_FIELD_ERROR, "{message}", {"path": path, "message": message, "value": value})


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
NonNegativeFloat = Annotated[float, Field(ge=0.0)]
PositiveFloat = Annotated[float, Field(gt=0.0)]


class ModelConfig(_Frozen):
    """Which checkpoint every worker runs, and how.

    ``source`` is a named model (see ``configs.models.NAMED_MODELS``), a Hugging Face directory
    (config.json + safetensors) or a ``.gguf`` file; files are checked by the loader on the
    worker's node, since paths may exist only there.
    """

    source: str = "gemma-3-270m"
    # auto: bfloat16 on CUDA, float32 on the CPU (bf16 matmuls are far slower than fp32 on CPUs)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    max_model_len: PositiveInt | None = None
    sliding_window_override: PositiveInt | None = None
    seed: int = 0
    weights_cache_dir: str | None = None
    # decode-only steps run from static, bucket-padded buffers (engine/model/decode_step.py),
    # captured as CUDA graphs on CUDA (models with sparse MoE layers stay eager there); false:
    # every step is built and run eagerly, unpadded
    cuda_graphs: bool = True

    @field_validator("source")
    @classmethod
    def _known_source(cls, source: str) -> str:
        classify_source(source)
        return source

    @property
    def source_kind(self) -> SourceKind:
        return classify_source(self.source)

    @property
    def resolved_dtype(self) -> str:
        """The dtype weights, activations and KV pages use: ``auto`` resolved for the device."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"


class PinningConfig(_Frozen):
    """The pinned retention tier of every worker's block pool (off by default)."""

    enabled: bool = False
    budget_blocks: Annotated[int, Field(ge=0)] | None = None  # None: up to the whole pool
    pin_sliding_window: bool = True
    min_drop_blocks: PositiveInt = 1


class OffloadConfig(_Frozen):
    """The host tier of every worker (off by default): cached blocks the device pools evict are
    copied to ``size_mib`` of host memory (pinned on CUDA), split between pools as the device
    KV memory is, and a later hit on them is copied back instead of recomputed."""

    enabled: bool = False
    size_mib: PositiveFloat = 1024.0
    #: host -> device copy bandwidth a worker reports to the router (its cost of a host-tier hit,
    #: ``WorkerLoad.promote_s_per_token``) until it has measured its own copies
    promote_gib_s: PositiveFloat = 8.0
    #: benchmarks: time a plain copy of each promote batch's bytes right after it, in the same
    #: process (CPU: a contiguous memcpy; CUDA: a pinned-memory async copy, both synchronised), so
    #: the promote bandwidth is compared with what a memcpy gets there (``engine/host_kv.py``)
    measure_memcpy: bool = False


class KVCacheConfig(_Frozen):
    """Paged KV-cache sizing and the prefix cache; exactly one of num_blocks / memory_budget_mib /
    gpu_memory_utilization sizes the pools."""

    block_size: PositiveInt = 16
    num_blocks: PositiveInt | None = None
    memory_budget_mib: PositiveFloat | None = 512.0
    # CUDA only: the share of the GPU's memory this worker may hold (weights, activations and KV
    # together); the KV budget is what is left of it once the weights are loaded
    # (engine/model/gpu_memory.py). Needs memory_budget_mib=null.
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # hybrid models: how memory_budget_mib is split between pools (engine/model/kv_budget.py):
    # running requests' recurrent states first, cached states at most this share of the rest
    state_cache_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    # typical shared-prefix length of the workload: caps cached states at one per prefix the
    # attention pool can hold (None: the fraction alone decides)
    expected_prefix_tokens: PositiveInt | None = None
    prefix_caching: bool = True
    pinning: PinningConfig = PinningConfig()
    offload: OffloadConfig = OffloadConfig()

    @model_validator(mode="after")
    def _one_size(self) -> KVCacheConfig:
        if self.num_blocks is not None and self.memory_budget_mib is not None:
            raise cross_field_error(
                "num_blocks",
                f"set either num_blocks or memory_budget_mib, not both (memory_budget_mib={self.memory_budget_mib})",
                self.num_blocks,
            )
        if self.gpu_memory_utilization is not None:
            for name in ("num_blocks", "memory_budget_mib"):
                if getattr(self, name) is not None:
                    raise cross_field_error(
                        "gpu_memory_utilization",
                        f"set either {name} or gpu_memory_utilization, not both ({name}={getattr(self, name)};"
                        f" set kv_cache.{name}=null)",
                        self.gpu_memory_utilization,
                    )
        elif self.num_blocks is None and self.memory_budget_mib is None:
            raise cross_field_error("num_blocks", "set num_blocks, memory_budget_mib or gpu_memory_utilization", None)
        if (
            self.pinning.budget_blocks is not None
            and self.num_blocks is not None
            and self.pinning.budget_blocks > self.num_blocks
        ):
            raise cross_field_error(
                "pinning.budget_blocks",
                f"must be <= kv_cache.num_blocks ({self.num_blocks})",
                self.pinning.budget_blocks,
            )
        return self


class SchedulerConfig(_Frozen):
    """Continuous batching limits of one engine step.

    ``async_scheduling``: overlap host and device: while the device runs one step (decode-only,
    prefill or mixed), the engine schedules and launches the next one (the input ids of requests
    that sample in the running step taken on the device from its sampled ids), and reads the
    earlier step's tokens only then (``EngineCore.step``); steps with a request whose sampling
    needs the host, a preemption, or a KV transfer to start run synchronously. Greedy and seeded
    tokens are the same either way.
    """

    max_num_batched_tokens: PositiveInt = 2048
    max_num_seqs: PositiveInt = 64
    prefill_chunk_size: PositiveInt = 512
    async_scheduling: bool = False

    @model_validator(mode="after")
    def _chunk_within_budget(self) -> SchedulerConfig:
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise cross_field_error(
                "prefill_chunk_size",
                f"must be <= scheduler.max_num_batched_tokens ({self.max_num_batched_tokens})",
                self.prefill_chunk_size,
            )
        return self


class WorkerResources(_Frozen):
    """Ray resources and compute threads of one worker actor."""

    num_cpus: NonNegativeFloat = 1.0
    num_gpus: NonNegativeFloat = 0.0
    num_threads: PositiveInt = 1
    custom_resources: dict[str, NonNegativeFloat] = Field(default_factory=dict)


class WorkersConfig(_Frozen):
    """How many prefill and decode workers run, and what each one asks of Ray.

    With ``role_resources`` on, prefill actors also require the custom resource ``prefill`` and
    decode actors ``decode`` (KubeRay worker groups advertise them), one unit each.

    Health: every driver checks each worker every ``health_check_interval_s``; a worker whose
    engine stopped, or that does not answer within ``health_check_timeout_s``, is taken out of
    the router like a dead one and (with ``replace_failed``) replaced by the process that started
    it. The same check renews the lease of each request the driver still waits on; a worker
    aborts a request whose lease is older than ``request_lease_s`` (its driver or client is
    gone), so its blocks never leak. ``engine_stall_timeout_s``: an engine thread that has not
    come round its loop for that long counts as unhealthy.
    """

    num_prefill: Annotated[int, Field(ge=0)] = 1
    num_decode: PositiveInt = 1
    prefill: WorkerResources = WorkerResources()
    decode: WorkerResources = WorkerResources()
    role_resources: bool = False
    health_check_interval_s: PositiveFloat = 2.0
    health_check_timeout_s: PositiveFloat = 10.0
    engine_stall_timeout_s: PositiveFloat = 120.0
    request_lease_s: PositiveFloat = 60.0
    replace_failed: bool = True
    # ranks per worker (tensor parallelism: engine/model/layers/parallel.py); the model's heads and
    # MLP width must divide by it, which the engine checks against the checkpoint before loading
    tensor_parallel_size: PositiveInt = 1

    @model_validator(mode="after")
    def _lease_outlives_renewals(self) -> WorkersConfig:
        floor = 2 * (self.health_check_interval_s + self.health_check_timeout_s)
        if self.request_lease_s < floor:
            raise cross_field_error(
                "request_lease_s",
                f"must be >= 2 x (health_check_interval_s + health_check_timeout_s) = {floor:g}, "
                "so a live driver always renews it in time",
                self.request_lease_s,
            )
        return self

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode


class TransferConfig(_Frozen):
    """How decode workers pull KV from prefill workers, and how failures are handled."""

    backend: Literal["nixl", "local"] = "nixl"
    read_timeout_s: PositiveFloat = 5.0
    release_timeout_s: PositiveFloat = 15.0
    on_failure: Literal["recompute", "fail"] = "recompute"
    ucx_net_devices: str = "lo"

    @model_validator(mode="after")
    def _owner_outlives_reader(self) -> TransferConfig:
        # The prefill side must not free (and reuse) blocks a decode worker may still be reading.
        if self.release_timeout_s <= self.read_timeout_s:
            raise cross_field_error(
                "release_timeout_s",
                f"must be > transfer.read_timeout_s ({self.read_timeout_s})",
                self.release_timeout_s,
            )
        return self


class RouterWeights(_Frozen):
    """Weights of the placement cost; all terms are non-negative."""

    uncached_tokens: NonNegativeFloat = 1.0
    queued_tokens: NonNegativeFloat = 0.5
    running_requests: NonNegativeFloat = 16.0
    used_block_fraction: NonNegativeFloat = 256.0
    #: per uncached token, on top of ``uncached_tokens``: the blocks it writes into the worker's
    #: cache evict other prefixes there (so a miss costs more than its own prefill)
    cache_churn: NonNegativeFloat = 1.0
    #: per second a worker spends copying a host-tier hit back to its device (a host hit token
    #: costs this times the worker's ``promote_s_per_token``, at most a miss): about the prefill
    #: tokens a worker computes in a second
    promote_seconds: NonNegativeFloat = 20000.0


class PinConfig(_Frozen):
    """A prefix kept resident on ``replicas`` workers; exactly one of ``text`` / ``token_ids``."""

    text: str | None = None
    token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    replicas: PositiveInt = 1
    ttl_s: PositiveFloat | None = None

    @model_validator(mode="after")
    def _one_prefix(self) -> PinConfig:
        if (self.text is None) == (self.token_ids is None):
            raise cross_field_error("text", "give exactly one of text or token_ids", self.text)
        return self


class AutoPinConfig(_Frozen):
    """Automatic pinning of the most requested shared prefixes within a block budget.

    The router counts the shared prefixes of the requests it routes (decaying counts) and keeps
    the most requested ones with at least ``min_requests`` pinned on ``replicas`` workers: a
    prefix asked for again and again, but less often than the workers' LRU turns over, stays
    resident instead of being evicted by one-off prompt tails. Automatic pins keep prefixes
    resident; they do not force placement (explicit pins do)."""

    enabled: bool = False
    #: cluster-wide budget in blocks; 0: ``budget_fraction`` of the prefill-capable workers' pools
    budget_blocks: Annotated[int, Field(ge=0)] = 0
    budget_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.3
    min_requests: PositiveInt = 2
    replicas: PositiveInt = 1
    #: seconds between two revisions of the automatic pins
    interval_s: PositiveFloat = 5.0
    #: with dedicated prefill and decode workers, also pin the hot prefixes in the decode
    #: workers' caches (within ``budget_fraction`` of their pools): P/D serves repeats from there
    on_decode_workers: bool = False


class RouterConfig(_Frozen):
    """Placement policy, its weights and thresholds, and cluster-wide pinned prefixes."""

    policy: Literal["kvfleet", "round_robin", "least_loaded", "prefix_tree"] = "kvfleet"
    weights: RouterWeights = RouterWeights()
    decode_only_threshold_tokens: Annotated[int, Field(ge=0)] = 64
    #: P/D: a decode worker prefills a long prompt itself while the prefill worker chosen for it
    #: is congested, its load costing more than this many uncached tokens
    #: (engine/routing/policy.py ``_whole_on_decode``; None: never). Off by default: in the host-tier
    #: benchmark a prefix first computed on a decode worker is missed again later more often
    #: (a decode worker's cache also holds every prompt it pulls), which cost more than the wait.
    local_prefill_margin_tokens: Annotated[int, Field(ge=0)] | None = None
    imbalance_ratio: Annotated[float, Field(ge=1.0)] = 2.0
    #: guard on the queue averaged over time (half-life ``load_halflife_s``; 0 turns it off)
    sustained_imbalance_ratio: Annotated[float, Field(ge=1.0)] = 1.3
    load_halflife_s: NonNegativeFloat = 5.0
    #: share of a full-attention depth whose windows are missing credited to that worker
    anchor_credit: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    #: the instantaneous guard ignores queues up to this many tokens above ``imbalance_ratio`` x mean
    imbalance_slack_tokens: NonNegativeFloat = 4096.0
    #: guard on work assigned lately (decaying with ``work_halflife_s``): a prefix holder above
    #: this ratio x the mean is left out (0 turns it off; otherwise it must be >= 1)
    work_imbalance_ratio: Annotated[float, Field(ge=0.0)] = 1.3
    work_halflife_s: PositiveFloat = 10.0
    #: work of one request beyond its uncached prompt tokens (decode), in prefill-token equivalents
    request_work_tokens: NonNegativeFloat = 256.0
    #: a prefix reused by fewer requests than this lately (each decaying with ``work_halflife_s``)
    #: is a family of its own, such as one conversation's earlier turns: a holder over its share
    #: keeps it, and its hit counts ``family_hit_weight`` more per token, for the copy a move
    #: strands there (engine/routing/prefix_reuse.py; 0: every prefix is priced alike)
    family_min_reuse: NonNegativeFloat = 2.0
    family_hit_weight: NonNegativeFloat = 1.0
    #: a prefix routed to a worker counts as held there until the worker reports its blocks,
    #: for at most this long (0 turns it off)
    inflight_ttl_s: NonNegativeFloat = 30.0
    pin_capacity_blocks: Annotated[int, Field(ge=0)] | None = None
    #: pins never take more than this share of one worker's pool
    pin_worker_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5
    pins: list[PinConfig] = Field(default_factory=list)
    auto_pin: AutoPinConfig = AutoPinConfig()
    seed: int = 0
    #: router actors, each with the full prefix index and fed every worker report; a request is
    #: routed by the replica its first block's hash picks (docs/architecture.md, Router replicas)
    replicas: Annotated[int, Field(ge=1, le=64)] = 1

    @field_validator("work_imbalance_ratio")
    @classmethod
    def _work_guard_off_or_ratio(cls, ratio: float) -> float:
        if 0.0 < ratio < 1.0:
            raise ValueError(f"must be 0 (off) or >= 1.0 (got {ratio})")
        return ratio


class RayConfig(_Frozen):
    """Which Ray cluster to use: an embedded one (address None) or an existing one ("auto", URL)."""

    address: str | None = None
    namespace: str = "kvfleet"
    num_cpus: PositiveFloat | None = None
    object_store_mib: PositiveInt = 256
    include_dashboard: bool = False


class LoggingConfig(_Frozen):
    """Log level and format of the driver, the actors and the job entrypoint."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: str = "%(asctime)s %(levelname)s %(name)s: %(message)s"

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, level: Any) -> Any:
        return level.upper() if isinstance(level, str) else level


class ServeConfig(_Frozen):
    """The OpenAI-compatible HTTP API (a Ray Serve application over the cluster).

    ``host`` / ``port`` are where ``kvfleet serve``'s ingress replicas serve HTTP (loopback by
    default; they share the port, ``serving/http_server.py``). ``api_key``: when set (here, or
    through the environment variable named by ``api_key_env``, which wins), every ``/v1`` route
    needs ``Authorization: Bearer <key>``;
    ``/health`` and ``/metrics`` stay open for probes and Prometheus scrapers (as vLLM's key
    does). ``max_queued_requests``: requests in flight (queued or
    running) per ingress replica; one more is answered 429 with ``Retry-After``.
    ``migration_limit``: how many times one request may move to another worker after its worker
    was lost mid-stream (it goes on there from its prompt and the tokens it already sent, so the
    client sees one unbroken stream; greedy and seeded sampling continue with the tokens an
    uninterrupted run gives, unseeded sampling with other random draws); 0 ends such a request
    with an error naming the worker. Every driver (the driver API, the CLI, the HTTP API) obeys it.
    """

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    #: the ``model`` name clients send and /v1/models lists; None: ``model.source``
    served_model_name: str | None = None
    api_key: str | None = None
    api_key_env: str = "KVFLEET_API_KEY"
    max_queued_requests: PositiveInt = 256
    ingress_replicas: PositiveInt = 1
    #: CPUs each ingress replica asks of Ray (tokenizing, detokenizing, HTTP)
    ingress_num_cpus: NonNegativeFloat = 0.5
    graceful_shutdown_timeout_s: PositiveFloat = 30.0
    retry_after_s: PositiveInt = 1
    migration_limit: NonNegativeInt = 2

    @field_validator("host")
    @classmethod
    def _host(cls, host: str) -> str:
        if not host.strip():
            raise ValueError(f"must not be empty (got {host!r})")
        return host

    @field_validator("served_model_name", "api_key")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"must not be empty (got {value!r})")
        return value


class ClusterConfig(_Frozen):
    """The whole cluster: model, KV cache, scheduler, workers, transfer, router, Ray, logging,
    and the HTTP API (``serve``)."""

    model: ModelConfig = ModelConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    workers: WorkersConfig = WorkersConfig()
    transfer: TransferConfig = TransferConfig()
    router: RouterConfig = RouterConfig()
    ray: RayConfig = RayConfig()
    logging: LoggingConfig = LoggingConfig()
    serve: ServeConfig = ServeConfig()

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        block_size = self.kv_cache.block_size
        if self.scheduler.prefill_chunk_size < block_size:
            raise cross_field_error(
                "scheduler.prefill_chunk_size",
                f"must be >= kv_cache.block_size ({block_size})",
                self.scheduler.prefill_chunk_size,
            )
        for i, pin in enumerate(self.router.pins):
            if pin.replicas > self.workers.num_workers:
                raise cross_field_error(
                    f"router.pins.{i}.replicas",
                    f"must be <= the number of workers ({self.workers.num_workers})",
                    pin.replicas,
                )
        if self.router.auto_pin.replicas > self.workers.num_workers:
            raise cross_field_error(
                "router.auto_pin.replicas",
                f"must be <= the number of workers ({self.workers.num_workers})",
                self.router.auto_pin.replicas,
            )
        if self.kv_cache.gpu_memory_utilization is not None and self.model.device != "cuda":
            raise cross_field_error(
                "kv_cache.gpu_memory_utilization",
                f"needs model.device=cuda (got {self.model.device!r}); size a CPU worker's cache with"
                " kv_cache.memory_budget_mib",
                self.kv_cache.gpu_memory_utilization,
            )
        pinning = self.kv_cache.pinning
        if not pinning.enabled:
            if self.router.pins:
                raise cross_field_error(
                    "router.pins", "pinned prefixes need kv_cache.pinning.enabled=true", len(self.router.pins)
                )
            if self.router.auto_pin.enabled:
                raise cross_field_error(
                    "router.auto_pin.enabled", "automatic pinning needs kv_cache.pinning.enabled=true", True
                )
        return self
