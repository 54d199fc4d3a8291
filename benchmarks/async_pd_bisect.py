"""Bisect the tiny-hybrid 2P2D divergence under ``scheduler.async_scheduling`` on CUDA.

``test_pd_race.py::test_engine_pd_stress_matches_the_single_engine[tiny-hybrid-local-2P2D]``
gave wrong greedy tokens on an H200 with async scheduling on (17 of 60), and passes on the CPU.
Each variant below runs the same seeded stress (``run_engine_stress``, async on unless named
``sync``) against one oracle computed with async off, and changes one thing:

- ``sync``: async off (the reference; expect 0 wrong);
- ``base``: async on (expect the failure);
- ``sync_launch``: ``torch.cuda.synchronize()`` after every ``ModelRunner.launch`` (0 wrong here
  means a device ordering race between a launched step and work queued after it);
- ``sync_reads``: every local-backend read waits for its copy before ``start_read`` returns, so
  a pulled request never joins ``running`` while a step is in flight (as on the CPU);
- ``torch_mamba``: ``KVFLEET_MAMBA_KERNEL=torch`` (the Triton decode kernels have no order
  across rows; the torch path gathers every state before it writes any);
- ``no_graphs``: every engine's decode and mixed graphs dropped after construction (the static
  buffers are replayed eagerly).

Every variant also checks, per launched or executed step, that no row's Mamba write block is
another row's read block and that no real row reads the null block (``alias``, ``null_reads``).
``--sync-debug`` also counts the synchronizing CUDA calls made inside ``launch`` (where the
overlap is lost), by source line, for tiny and tiny-hybrid.

    KVFLEET_TEST_DEVICE=cuda python -m benchmarks.async_pd_bisect [--variants base,sync_launch] \
        [--seeds 1,7] [--shape 2x2] [--sync-debug]

Prints one JSON line per variant and seed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator

import torch

from engine.core import EngineCore
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.transfer import local_cuda
from kvfleet_testing.pd_harness import STRESS_OVERRIDES, alone_tokens, run_engine_stress
from kvfleet_testing.presets import load_preset
from kvfleet_testing.workloads import shared_prefix_prompts

VARIANTS = ("sync", "base", "sync_launch", "sync_reads", "torch_mamba", "no_graphs")


@contextlib.contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def step_checks(stats: Counter) -> contextlib.ExitStack:
    """Wrap launch and execute with the Mamba aliasing checks; count where pulled requests join,
    expired handles and overlapped steps."""

    def check(runner: ModelRunner, output) -> None:
        bs = runner.layout.block_size
        for g, mamba in enumerate(runner.is_mamba):
            if not mamba:
                continue
            reads = {c.request.request_id: c.block_ids[g][(c.start - 1) // bs] for c in output.chunks if c.start}
            writes = {c.request.request_id: c.block_ids[g][(c.start + c.num_tokens - 1) // bs] for c in output.chunks}
            stats["null_reads"] += sum(block == 0 for block in reads.values())
            stats["alias"] += sum(w == r and w and a != b for a, w in writes.items() for b, r in reads.items())

    launch, execute = ModelRunner.launch, ModelRunner.execute
    step, finish_kv_load, close = EngineCore.step, Scheduler.finish_kv_load, EngineCore.close
    stepping: list[EngineCore] = []

    def counted_step(self):
        stepping[:] = [self]
        return step(self)

    def counted_finish(self, request_id, ok):
        # a pulled request joining ``running`` while a launched step runs (CUDA only: on the CPU a
        # read is done when it starts, and ``add_request`` drained the engine before it)
        stats["joined_mid_chain" if stepping and stepping[0].in_flight is not None else "joined_idle"] += 1
        return finish_kv_load(self, request_id, ok)

    def counted_close(self):
        if self.handoff is not None:
            stats["expired_handles"] += self.handoff.stats.expired_handles
        stats["overlapped_steps"] += self.counters.overlapped_steps
        return close(self)

    def checked_launch(self, output, previous=None):
        check(self, output)
        return launch(self, output, previous)

    def checked_execute(self, output):
        check(self, output)
        return execute(self, output)

    stack = contextlib.ExitStack()
    stack.enter_context(patched(EngineCore, "step", counted_step))
    stack.enter_context(patched(Scheduler, "finish_kv_load", counted_finish))
    stack.enter_context(patched(EngineCore, "close", counted_close))
    stack.enter_context(patched(ModelRunner, "launch", checked_launch))
    stack.enter_context(patched(ModelRunner, "execute", checked_execute))
    return stack


def variant_patches(variant: str) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    cuda = torch.cuda.is_available()
    if variant == "sync_launch" and cuda:
        launch = ModelRunner.launch

        def launch_then_sync(self, output, previous=None):
            pending = launch(self, output, previous)
            torch.cuda.synchronize()
            return pending

        stack.enter_context(patched(ModelRunner, "launch", launch_then_sync))
    elif variant == "sync_reads" and cuda:
        copy_rows = local_cuda.copy_rows

        def copy_and_wait(*args, **kwargs):
            event = copy_rows(*args, **kwargs)
            event.synchronize()
            return event

        stack.enter_context(patched(local_cuda, "copy_rows", copy_and_wait))
    elif variant == "torch_mamba":
        previous = os.environ.get("KVFLEET_MAMBA_KERNEL")
        os.environ["KVFLEET_MAMBA_KERNEL"] = "torch"
        if previous is None:
            stack.callback(os.environ.pop, "KVFLEET_MAMBA_KERNEL", None)
        else:
            stack.callback(os.environ.__setitem__, "KVFLEET_MAMBA_KERNEL", previous)
    elif variant == "no_graphs":
        init = EngineCore.__init__

        def init_without_graphs(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.runner.close()  # drops the decode and mixed graphs; the static buffers stay

        stack.enter_context(patched(EngineCore, "__init__", init_without_graphs))
    return stack


def sync_calls(preset: str, seed: int, shape: tuple[int, int]) -> dict[str, int]:
    """Synchronizing CUDA calls inside ``ModelRunner.launch``, by the engine's source line."""
    found: Counter = Counter()
    launch = ModelRunner.launch

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/engine/" in f.filename]
        where = frames[-1] if frames else None
        found[f"{where.filename.split('/engine/')[-1]}:{where.lineno}" if where else f"{filename}:{lineno}"] += 1

    def watched(self, output, previous=None):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return launch(self, output, previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    with warnings.catch_warnings(), patched(ModelRunner, "launch", watched), patched(warnings, "showwarning", show):
        warnings.simplefilter("always")
        run_engine_stress(
            preset,
            "local",
            *shape,
            requests=60,
            seed=seed,
            oracle={tuple(p): [] for p in shared_prefix_prompts(seed, 60)},
            overrides=(*STRESS_OVERRIDES, "scheduler.async_scheduling=true"),
        )
    return dict(found.most_common(30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--shape", default="2x2")
    ap.add_argument("--preset", default="tiny-hybrid")
    ap.add_argument("--sync-debug", action="store_true")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    shape = tuple(int(n) for n in args.shape.split("x"))
    assert len(shape) == 2
    started = time.monotonic()
    prompts = [p for seed in seeds for p in shared_prefix_prompts(seed, 60)]
    oracle = alone_tokens(load_preset(args.preset, ["scheduler.async_scheduling=false"]), prompts)
    print(json.dumps({"oracle_s": round(time.monotonic() - started, 1)}), flush=True)
    for variant in args.variants.split(","):
        flag = "false" if variant == "sync" else "true"
        for seed in seeds:
            stats: Counter = Counter()
            with variant_patches(variant), step_checks(stats):
                result = run_engine_stress(
                    args.preset,
                    "local",
                    *shape,
                    requests=60,
                    seed=seed,
                    oracle=oracle,
                    overrides=(*STRESS_OVERRIDES, f"scheduler.async_scheduling={flag}"),
                )
            line = {"variant": variant, "seed": seed, **dict(stats), **result.as_dict()}
            line["mismatches"] = line["mismatches"][:8]
            print(json.dumps(line), flush=True)
    if args.sync_debug and torch.cuda.is_available():
        for preset in ("tiny", "tiny-hybrid"):
            lines = sync_calls(preset, seeds[0], shape)
            print(json.dumps({"sync_calls_in_launch": preset, "lines": lines}), flush=True)


if __name__ == "__main__":
    main()
