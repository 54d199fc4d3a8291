"""EngineCore: one worker's synchronous engine — scheduler + coordinator + model runner.

``add_request`` / ``step`` / ``abort``; no threads, no ray. ``step`` schedules, runs the model and
returns the tokens each request gained, with finish flags.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from configs.schema import ClusterConfig
from configs.models import SourceKind
from engine.kv_cache.coordinator import HybridCoordinator, RetentionOptions
from engine.model.arch import ModelArch
from engine.model.kv_layout import build_kv_layout
from engine.model.loader import CheckpointError, build_model, load_hf_directory
from engine.request import Request
from engine.runner import TORCH_DTYPES, ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestOutput, Scheduler

log = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE", Path.home() / ".cache" / "kvfleet"))


def resolve_model_directory(config: ClusterConfig) -> Path:
    """The Hugging Face directory to load for ``config.model.source`` (building tiny models)."""
    model = config.model
    kind = model.source_kind
    if kind is SourceKind.HF_DIRECTORY:
        return Path(model.source).expanduser()
    if kind is SourceKind.TINY_RANDOM:
        from engine.model.tiny import build_tiny_checkpoint

        directory = Path(model.weights_cache_dir or cache_root() / "tiny") / f"{model.source}-seed{model.seed}"
        if not (directory / "config.json").is_file():
            log.info("building tiny random checkpoint %s in %s", model.source, directory)
            build_tiny_checkpoint(model.source, directory, seed=model.seed)
        return directory
    from engine.model.gguf import ensure_hf_directory

    cache = Path(model.weights_cache_dir) if model.weights_cache_dir else None
    return ensure_hf_directory(model.source, cache)


@dataclass(frozen=True)
class EngineInfo:
    arch: ModelArch
    num_blocks: int
    block_size: int
    max_model_len: int


class EngineCore:
    """Owns the scheduler, the KV-cache coordinator and the model runner of one worker."""

    def __init__(self, config: ClusterConfig, model_directory: str | Path | None = None, threads: int | None = None):
        self.config = config
        if threads:
            torch.set_num_threads(threads)
        directory = Path(model_directory) if model_directory else resolve_model_directory(config)
        arch, weights = load_hf_directory(directory, config.model.sliding_window_override)
        dtype = "float32" if config.model.dtype == "auto" else config.model.dtype
        device = torch.device(config.model.device)
        cache = config.kv_cache
        layout = build_kv_layout(arch, cache.block_size, dtype)
        model = build_model(arch, layout.layer_group, weights, TORCH_DTYPES[dtype], device, str(directory))
        del weights
        num_blocks = cache.num_blocks or layout.num_blocks_for_budget(int(cache.memory_budget_mib * 2**20))
        max_model_len = config.model.max_model_len or arch.max_position_embeddings
        pinning = cache.pinning
        self.coordinator = HybridCoordinator(
            layout.groups,
            num_blocks,
            enable_caching=cache.prefix_caching,
            retention=RetentionOptions(
                pinning.enabled, pinning.budget_blocks, pinning.pin_sliding_window, pinning.min_drop_blocks
            ),
            enable_events=True,
            max_model_len=max_model_len,
        )
        self.scheduler = Scheduler(config.scheduler, self.coordinator, max_model_len)
        self.runner = ModelRunner(arch, layout, model, num_blocks, device, dtype)
        self.info = EngineInfo(arch, num_blocks, cache.block_size, max_model_len)
        self.model_directory = directory
        eos = arch.eos_token_ids
        self.eos_token_id = eos[0] if eos else None
        log.info(
            "engine ready: %s, %d layers, %d KV groups, %d blocks of %d tokens",
            arch.architecture, arch.num_layers, len(layout.groups), num_blocks, cache.block_size,
        )  # fmt: skip

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> Request:
        request = Request(
            request_id, prompt_token_ids, sampling, self.coordinator.hash_block_size, eos_token_id=self.eos_token_id
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> list[RequestOutput]:
        output = self.scheduler.schedule()
        sampled = self.runner.execute(output)
        results = self.scheduler.update(output, sampled)
        for result in results:
            if result.finished:
                self.runner.sampler.forget(result.request_id)
        return results

    def abort(self, request_id: str) -> bool:
        self.runner.sampler.forget(request_id)
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work
