"""Where an ``EngineCore.step`` spends its host time, phase by phase, without touching the engine's code.

``StepPhases(engine)`` wraps, on that engine instance only, the calls a step makes: the scheduler's
``schedule`` and ``update``, the batch build (``ModelRunner.build_batch`` for eager steps,
``DecodeStep._prepare`` for decode-only steps), the model's forward (eager, or the CPU's padded
decode forward), a CUDA graph replay (``forward`` as well: launching it is the forward's host
cost), the logits and the sampler. Each phase's time is the wall time until its call returns, so
on CUDA asynchronous work shows up where the host waits for it (the sampler's read of the sampled
ids). A step's host time is its wall time minus the model's forward and logits: on the CPU exactly
the host work around the model (scheduling, batch build, sampling, update, and the step's glue);
``summary`` reports its median over the timed steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from engine.core import EngineCore

PHASES = ("schedule", "batch_build", "forward", "logits", "sample", "update")
MODEL_PHASES = ("forward", "logits")  # the model's own compute, left out of host_ms


class StepPhases:
    """Owns the per-phase seconds of the steps it times. ``step()`` runs one engine step and
    records it; ``summary(steps)`` gives mean milliseconds per step for each phase and ``host``."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.step_seconds = 0.0
        self.steps = 0
        self.host_per_step: list[float] = []  # each step's wall time minus its forward and logits
        runner, scheduler = engine.runner, engine.scheduler
        self._wrap(scheduler, "schedule", "schedule")
        self._wrap(scheduler, "update", "update")
        self._wrap(runner, "build_batch", "batch_build")
        self._wrap(runner.sampler, "sample", "sample")
        self._wrap(runner.model, "forward", "forward")
        self._wrap(runner.model, "logits", "logits")
        decode = runner.decode
        if decode is not None:
            self._wrap(decode, "_prepare", "batch_build")
            for graph, _ in decode._graphs.values():
                self._wrap(graph, "replay", "forward")

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - begin

        setattr(owner, name, timed)

    def step(self) -> list:
        model_before = self._model_seconds()
        begin = time.perf_counter()
        outputs = self.engine.step()
        wall = time.perf_counter() - begin
        self.step_seconds += wall
        self.steps += 1
        self.host_per_step.append(wall - (self._model_seconds() - model_before))
        return outputs

    def _model_seconds(self) -> float:
        return sum(self.seconds[p] for p in MODEL_PHASES)

    def reset(self) -> None:
        """Forget the steps timed so far (the wrappers keep writing into the same dict)."""
        self.step_seconds, self.steps = 0.0, 0
        self.host_per_step.clear()
        for phase in PHASES:
            self.seconds[phase] = 0.0

    def summary(self) -> dict[str, float]:
        """Mean ms per step of each phase and of ``step`` (wall); ``host``: the median over steps
        of wall minus forward and logits (a median, because a shared machine's stalls land on a
        few steps), ``host_mean`` its mean."""
        steps = max(self.steps, 1)
        out = {phase: round(self.seconds[phase] / steps * 1e3, 4) for phase in PHASES}
        out["step"] = round(self.step_seconds / steps * 1e3, 4)
        host = self.host_per_step or [0.0]
        out["host"] = round(statistics.median(host) * 1e3, 4)
        out["host_mean"] = round(statistics.fmean(host) * 1e3, 4)
        return out
