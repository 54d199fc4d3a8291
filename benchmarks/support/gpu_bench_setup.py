"""The setup of ``benchmarks/engine_gpu.py``: the models, the run's sizes and state, the checkpoints.

Owns the models' shapes (``MODELS``: Gemma-3-270M's published shape and Bamba-9B's proportions,
with ``QUICK_MODELS``' tiny shapes for ``--quick``; ``DECODE_MODEL`` is the one whose decode steps
are timed), everything a run's size depends on (``Sizes``, the full run's defaults, and ``QUICK``),
one run's arguments, device, deadline and result with its phase runner (``Run``, ``OutOfTime`` when
``--max-seconds`` has passed), and the random checkpoint of one model in the run's dtype
(``build_checkpoint``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.mamba_decode import BAMBA_SCALED
from engine.model.checkpoints.gguf_named_models import NAMED_MODELS
from engine.model.checkpoints.random_checkpoint import write_random_checkpoint
from engine.runner import TORCH_DTYPES

log = logging.getLogger("engine_gpu")  # the script's logger: progress reads as it did

_GEMMA_PUBLISHED = {k: v for k, v in NAMED_MODELS["gemma-3-270m"].expected_config.items() if k != "architectures"}
# name -> (config class, model class, fields): the full shapes and the --quick ones
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **_GEMMA_PUBLISHED,
            "intermediate_size": 2048,
            "query_pre_attn_scalar": 256,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
        },
    ),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        {
            **BAMBA_SCALED,
            "hidden_size": 1536,
            "intermediate_size": 5376,
            "num_hidden_layers": 10,
            "attn_layer_indices": [3, 7],
            "num_attention_heads": 12,
            "num_key_value_heads": 3,
            "mamba_n_heads": 48,
        },
    ),
}
QUICK_MODELS: dict[str, dict[str, Any]] = {
    "gemma": {
        "vocab_size": 4096,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "head_dim": 32,
        "sliding_window": 32,
        "query_pre_attn_scalar": 32,
        "max_position_embeddings": 4096,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "bamba": {
        "vocab_size": 4096,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "attn_layer_indices": [1],
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
    },
}
DECODE_MODEL = "gemma"


@dataclass(frozen=True)
class Sizes:
    """Everything a run's size depends on (the full run's, or ``--quick``'s)."""

    num_requests: int = 64
    prompt_lens: tuple[int, int] = (64, 1024)
    output_lens: tuple[int, int] = (16, 256)
    hf_batch: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    prefill_chunk_size: int = 1024
    kv_budget_mib: int = 8192
    warmup_requests: int = 16
    warmup_prompt_len: int = 64
    warmup_tokens: int = 8
    decode_batches: tuple[int, ...] = (1, 8, 64)
    decode_prompt_len: int = 512
    decode_warmup_steps: int = 3
    decode_steps: int = 32
    profile_steps: int = 5
    copy_mib: int = 1024
    copy_reps: int = 20


QUICK = Sizes(
    num_requests=8,
    prompt_lens=(16, 64),
    output_lens=(4, 16),
    hf_batch=4,
    kv_budget_mib=64,
    warmup_requests=2,
    warmup_prompt_len=16,
    warmup_tokens=2,
    decode_batches=(1, 8, 64),
    decode_prompt_len=48,
    decode_warmup_steps=3,
    decode_steps=32,
    copy_mib=64,
    copy_reps=5,
)


class OutOfTime(RuntimeError):
    """``--max-seconds`` passed: the phase in progress is given up."""


@dataclass
class Run:
    """One benchmark run: its arguments and sizes, the device, the deadline and the result so far."""

    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    end: float
    result: dict[str, Any]

    def check(self, what: str) -> None:
        if time.perf_counter() > self.end:
            raise OutOfTime(f"{what}: --max-seconds reached")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def attempt(self, phase: str, fn: Callable[[], Any]) -> Any:
        """Run one phase unless ``--max-seconds`` has passed; a failure (or ``OutOfTime``) is
        logged and named in ``result["errors"]``, and the run goes on without that phase."""
        try:
            self.check(phase)
            return fn()
        except OutOfTime as exc:
            log.warning("%s skipped: %s", phase, exc)
            self.result["errors"][phase] = f"OutOfTime: {exc}"
        except Exception as exc:
            log.exception("%s failed", phase)
            self.result["errors"][phase] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None


# -- checkpoints ---------------------------------------------------------------------------------------
def build_checkpoint(run: Run, name: str, directory: Path, full: bool = False) -> Path:
    """Write the random checkpoint ``name`` in the run's dtype, initialised on the device (on the
    CPU if that fails) and saved from the CPU; ``--quick``'s tiny shape unless ``full``."""
    config_cls, model_cls, shape = MODELS[name]
    shape = {**shape, **(QUICK_MODELS[name] if run.args.quick and not full else {})}
    dtype = TORCH_DTYPES[run.args.dtype]
    start = time.perf_counter()
    for build_device in dict.fromkeys([run.device, torch.device("cpu")]):
        try:
            with torch.device(build_device):
                write_random_checkpoint(
                    config_cls,
                    model_cls,
                    shape,
                    directory,
                    run.args.seed,
                    finish=lambda model: model.to(device="cpu", dtype=dtype),
                )
            break
        except Exception as exc:
            if build_device.type == "cpu":
                raise
            log.warning("%s: building on %s failed (%s); building on the CPU", name, build_device, exc)
        finally:
            run.release_memory()
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    log.info(
        "%s: random checkpoint, %.0f MiB %s, in %.1f s", name, size / 2**20, run.args.dtype, time.perf_counter() - start
    )
    return directory
