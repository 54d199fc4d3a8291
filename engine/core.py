"""EngineCore: one worker's synchronous engine — scheduler + coordinator + model runner, and
(with a ``kv_role``) the P/D hand-off of prefill/decode disaggregation.

``add_request`` / ``step`` / ``abort``; no threads, no ray. ``step`` progresses transfers,
schedules, runs the model and returns the tokens each request gained, with finish flags.
P/D (see ``engine.disagg``): ``add_request(prefill_only=True)`` on the prefill engine finishes
with ``finish_reason="remote_decode"`` and a ``KVHandle``; ``add_request(kv_handle=...)`` on the
decode engine pulls that KV, then decodes. The transfer state (exported and held blocks, reads in
flight, announced remote prefills, peer warm-ups) lives in the ``PDHandoff`` the engine owns
(``engine.pd_handoff``); the engine's P/D methods check their arguments and delegate to it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from configs.cache import cache_root
from configs.models import SourceKind
from configs.schema import ClusterConfig
from engine.disagg import KVHandle, check_handle
from engine.kv_cache.coordinator import HybridCoordinator, RetentionOptions
from engine.kv_cache.events import KVEvent
from engine.model.arch.model_arch import ModelArch
from engine.model.checkpoints.loader import build_model, load_hf_directory
from engine.model.gpu_memory import worker_pool_blocks
from engine.model.kv_layout import build_kv_layout
from engine.model.layers.parallel import shard_arch
from engine.pd_handoff import PDHandoff
from engine.request import Request, RequestStatus, UncheckedRequestError
from engine.runner import TORCH_DTYPES, ModelRunner
from engine.sampler import PendingTokens, SampledTokens
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestOutput, Scheduler, SchedulerOutput
from engine.structured_output import StructuredOutputs
from engine.tokenizer import load_tokenizer
from engine.transfer import AgentInfo, KVTransfer, Role, transfer_from_config
from engine.worker_view import EngineCounters, WorkerView

KVRole = Literal["prefill", "decode", "both"]
#: batches in a row whose forward raised before an engine counts as broken (``EngineBroken``)
MAX_CONSECUTIVE_FAILED_STEPS = 3
_TRANSFER_ROLE: dict[KVRole, Role] = {"prefill": "owner", "decode": "reader", "both": "both"}

log = logging.getLogger(__name__)


class EngineBroken(RuntimeError):
    """The engine cannot go on (its state is inconsistent, or every step fails): the worker
    owning it must be taken out of service and replaced."""


def resolve_model_directory(config: ClusterConfig) -> Path:
    """The Hugging Face directory to load for ``config.model.source`` (building tiny models)."""
    model = config.model
    kind = model.source_kind
    if kind is SourceKind.HF_DIRECTORY:
        return Path(model.source).expanduser()
    if kind is SourceKind.TINY_RANDOM:
        from engine.model.checkpoints.tiny import build_tiny_checkpoint

        directory = Path(model.weights_cache_dir or cache_root() / "tiny") / f"{model.source}-seed{model.seed}"
        if not (directory / "config.json").is_file():
            log.info("building tiny random checkpoint %s in %s", model.source, directory)
            build_tiny_checkpoint(model.source, directory, seed=model.seed)
        return directory
    from engine.model.checkpoints.gguf import ensure_hf_directory

    cache = Path(model.weights_cache_dir) if model.weights_cache_dir else None
    return ensure_hf_directory(model.source, cache)


@dataclass(frozen=True)
class EngineInfo:
    arch: ModelArch
    num_blocks: int
    block_size: int
    max_model_len: int
    pool_blocks: tuple[int, ...] = ()  # blocks per pool (null included); num_blocks is pool 0's


@dataclass(frozen=True)
class LaunchedStep:
    """A step the device may still be running (a decode, prefill or mixed step,
    ``ModelRunner.launch``): what was scheduled, and its tokens on their way to the host."""

    output: SchedulerOutput
    tokens: PendingTokens


class EngineCore:
    """Owns the scheduler, the KV-cache coordinator, the model runner and (with a ``kv_role``)
    the transfer object of one worker and its P/D hand-off (``handoff``: the transfer state),
    and (with ``scheduler.async_scheduling``) the one step launched but not yet read.

    Invariants: every block is owned by exactly one of: a running / waiting-for-KV request, a
    prefill-only request held for its reader (released on the reader's notification or after
    ``transfer.release_timeout_s``), or the pool; a transfer only writes blocks the coordinator
    allocated to the request it serves, and those stay allocated until the read has ended; at
    most one step is in flight (``in_flight``), and nothing but its own continuation is
    scheduled while it is (every other path drains it first, ``drain``).
    """

    def __init__(
        self,
        config: ClusterConfig,
        model_directory: str | Path | None = None,
        threads: int | None = None,
        *,
        name: str | None = None,
        kv_role: KVRole | None = None,
        tensor_parallel_rank: int = 0,
    ):
        self.config = config
        if threads:
            torch.set_num_threads(threads)
        if kv_role is not None and kv_role not in _TRANSFER_ROLE:
            raise ValueError(f"kv_role: expected one of {sorted(_TRANSFER_ROLE)} or None, got {kv_role!r}")
        directory = Path(model_directory) if model_directory else resolve_model_directory(config)
        arch, weights = load_hf_directory(directory, config.model.sliding_window_override)
        full_kv_heads = arch.num_kv_heads
        # this rank's part of the model (engine/model/layers/parallel.py); the same arch at TP=1
        arch = shard_arch(arch, config.workers.tensor_parallel_size, tensor_parallel_rank)
        dtype = config.model.resolved_dtype
        device = torch.device(config.model.device)
        cache = config.kv_cache
        layout = build_kv_layout(arch, cache.block_size, dtype)
        model = build_model(
            arch, layout.layer_group, weights, TORCH_DTYPES[dtype], device, str(directory), full_kv_heads
        )
        del weights
        num_blocks, host_blocks = worker_pool_blocks(arch, layout, config, device, TORCH_DTYPES[dtype].itemsize)
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
            host_blocks=host_blocks,
        )
        self.scheduler = Scheduler(config.scheduler, self.coordinator, max_model_len)
        self.name = name or (kv_role or "engine")
        self.kv_role = kv_role
        self.transfer: KVTransfer | None = None
        if kv_role is not None:
            self.transfer = transfer_from_config(config.transfer, self.name, role=_TRANSFER_ROLE[kv_role])
        # the static steps run on one rank only: split workers run every step eagerly
        static = config.model.cuda_graphs and arch.tp_size == 1
        decodes = static and kv_role != "prefill"
        try:
            allocate = self.transfer.allocate_slots if self.transfer is not None else None
            self.runner = ModelRunner(
                arch,
                layout,
                model,
                num_blocks,
                device,
                dtype,
                allocate_slots=allocate,
                # model.cuda_graphs=false: no static decode step, every step eager and unpadded; a
                # prefill worker never decodes, so it has none either
                max_num_seqs=config.scheduler.max_num_seqs if decodes else None,
                max_model_len=max_model_len,
                # prefill and mixed steps: the static token-bucket step (engine/model/mixed_step.py)
                max_num_batched_tokens=config.scheduler.max_num_batched_tokens if static else None,
                cuda_graphs=config.model.cuda_graphs,
                # the grammars of structured-output requests: the tokenizer is loaded (once per
                # engine) when the first one arrives
                structured=StructuredOutputs(
                    functools.partial(load_tokenizer, directory, arch.vocab_size),
                    arch.vocab_size,
                    arch.eos_token_ids,
                    threads=threads or 1,
                ),
                host_blocks=host_blocks,
            )
            self._agent_info = (
                self.transfer.register(self.runner.slots, layout.slot_pool) if self.transfer is not None else None
            )
        except BaseException:
            if self.transfer is not None:
                self.transfer.close()
            raise
        self.layout = layout
        self.layout_key = f"{arch.architecture}|{dtype}|{layout.describe()}"
        self.handoff: PDHandoff | None = None
        if self.transfer is not None and self._agent_info is not None:
            self.handoff = PDHandoff(
                self.name,
                config.transfer,
                self.transfer,
                self._agent_info,
                self.layout_key,
                [group.pool for group in layout.groups],
                self.scheduler,
                self.coordinator,
                self.runner,
                exports_prefills=kv_role != "decode",
            )
        if host_blocks is not None:
            # an admission whose external tokens a transfer writes: the offloads it queued read
            # those blocks first, so they run (to completion) before the transfer starts
            self.coordinator.copy_now = functools.partial(self.runner.copy_tiers, wait=True)
            if cache.offload.measure_memcpy and self.runner.host_kv is not None:
                self.runner.host_kv.time_reference_copies()
        self.consecutive_failed_steps = 0
        self.async_scheduling = config.scheduler.async_scheduling
        #: the step launched but not read yet (``step``); its outputs come with a later step
        self.in_flight: LaunchedStep | None = None
        #: counters each step changes (prompt tokens being computed, failed steps and requests)
        self.counters = EngineCounters()
        #: outputs of an in-flight step read early (``drain``), returned by the next ``step``
        self._drained: list[RequestOutput] = []
        #: called right after each step's scheduling, before the forward (the owner reports the
        #: cache events of that scheduling: the blocks it evicted are gone already)
        self.on_scheduled: Callable[[], None] | None = None
        self.info = EngineInfo(arch, num_blocks[0], cache.block_size, max_model_len, num_blocks)
        #: what the worker actor reports and asks (loads, stats, pins); reads the parts above live
        self.worker_view = WorkerView(
            self.scheduler,
            self.coordinator,
            self.runner,
            layout,
            num_blocks,
            self.handoff,
            self.counters,
            cache.offload.promote_gib_s,
        )
        self.model_directory = directory
        eos = arch.eos_token_ids
        self.eos_token_id = eos[0] if eos else None
        log.info(
            "engine %s ready: %s, %d layers, %d KV groups, blocks per pool %s (%s), %d-token pages%s",
            self.name,
            arch.architecture,
            arch.num_layers,
            len(layout.groups),
            list(num_blocks),
            ", ".join(f"{p.kind} {p.page_bytes} B x {p.num_slots}" for p in layout.pools),
            cache.block_size,
            f", kv_role={kv_role} ({config.transfer.backend})" if kv_role else "",
        )

    @property
    def agent_info(self) -> AgentInfo:
        """This worker's transfer registration (plain data a peer needs to read its blocks)."""
        if self.handoff is None:
            raise ValueError(f"engine {self.name!r}: no kv_role, so no transfer registration")
        return self.handoff.agent_info  # with the other ranks' when split (``engine.rank_group``)

    def _handoff_for(self, action: str) -> PDHandoff:
        """The P/D hand-off, or ValueError naming ``kv_role`` when this engine has none."""
        if self.handoff is None:
            raise ValueError(f"kv_role: engine {self.name!r} was built without one, so it cannot {action}")
        return self.handoff

    # -- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        prefill_only: bool = False,
        kv_handle: KVHandle | None = None,
        cache_salt: str | None = None,
        output_token_ids: Sequence[int] = (),
    ) -> Request:
        """Queue a request its entry point checked (``engine.validation``: ``LLM`` for the offline
        API, the driver for a cluster); the engine only asserts what its bookkeeping needs
        (``UncheckedRequestError``). ``prefill_only``: compute its prompt's KV for a decode
        worker (the result carries a ``KVHandle``); ``kv_handle``: pull that KV instead of
        computing it (a handle that does not fit this engine is a ValueError naming its field).
        ``cache_salt``: its prompt's blocks are hashed with it (shared only with the same salt).
        ``output_token_ids``: resume a request that generated these tokens elsewhere (a worker
        that died mid-stream): the engine prefills prompt + outputs (its prefix cache serves what
        it can) and generates the rest; they count toward ``max_tokens``, the penalties and the
        seeded draw index, so greedy and seeded runs continue exactly as uninterrupted ones.
        Only computed here (not with ``prefill_only`` or ``kv_handle``); a resumed request does
        not report ``prompt_logprobs`` again (they came with its first output)."""
        assert not (prefill_only and kv_handle is not None), "a request is either prefilled here or pulled"
        assert not (output_token_ids and (prefill_only or kv_handle is not None)), "a resumed request is computed here"
        if prefill_only:
            self._handoff_for("do P/D transfers")
            request = self._new_request(request_id, prompt_token_ids, sampling, cache_salt, prefill_only=True)
            self.scheduler.add_request(request)
            return request
        request = self._new_request(
            request_id,
            prompt_token_ids,
            sampling,
            cache_salt,
            remote_prefill=kv_handle is not None,
            outputs=output_token_ids,
        )
        if kv_handle is None:
            self.scheduler.add_request(request)
        else:
            handoff = self._handoff_for("do P/D transfers")
            check_handle(kv_handle, self.layout_key, request.token_ids)
            self.drain()  # the read may land in blocks an in-flight step still writes (``drain``)
            handoff.start_load(request, kv_handle)
        self._constrain(request)
        return request

    def _constrain(self, request: Request) -> None:
        """Register a queued request's structured output (if it has one) with the runner, whose
        masks then keep its samples inside the grammar; a resumed request's outputs advance it.
        A spec that does not compile (its entry point checks it first) or resumed outputs that
        do not fit abort the request and raise ValueError."""
        structured = request.sampling.structured
        if structured is None:
            return
        try:
            self.runner.structured.add(request.request_id, structured, request.output_token_ids)
        except ValueError:
            self.abort(request.request_id)
            raise

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        cache_salt: str | None,
        *,
        prefill_only: bool = False,
        remote_prefill: bool = False,
        outputs: Sequence[int] = (),
    ) -> Request:
        """A new Request of checked arguments; a ``prefill_only`` one covers all but the prompt's
        last token. Asserts cheaply: a SamplingParams (checked when it was built), an id no
        announced remote prefill holds, and a prompt the scheduler's ``check_new`` bounds."""
        assert isinstance(sampling, SamplingParams), "sampling: checked (coerced) at the entry point"
        if self.handoff is not None and self.handoff.expects(request_id):
            raise UncheckedRequestError(f"request {request_id!r} is already in this engine")
        prompt = prompt_token_ids
        if prefill_only:
            if len(prompt) < 2:
                raise ValueError(
                    f"prompt_token_ids: a prefill-only request needs >= 2 tokens (got {len(prompt)}); run it colocated"
                )
            prompt = prompt[:-1]
        return Request(
            request_id,
            list(prompt),
            sampling,
            self.coordinator.hash_block_size,
            self.eos_token_id,
            cache_salt,
            remote_prefill=remote_prefill,
            prefill_only=prefill_only,
            output_token_ids=outputs,
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks (once any read into them has ended).
        Tokens an in-flight step gave it are dropped: the caller never saw them."""
        self.drain()
        dropped = any(out.request_id == request_id for out in self._drained)
        if dropped:
            self._drained = [out for out in self._drained if out.request_id != request_id]
        self.runner.forget(request_id)
        if self.handoff is not None and self.handoff.abort(request_id):
            return True
        return self.scheduler.abort(request_id) or dropped

    # -- P/D: the decode side before the handle arrives, and exports (delegated to ``handoff``) ------
    def expect_remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        peer: AgentInfo | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Request:
        """Announce a request whose prompt KV (all but the last token) a prefill worker is
        computing now: reserve its blocks (if they fit) and warm the connection to ``peer``.
        Its handle comes later through ``provide_handle``. The prefill worker hashes the
        prompt with the same ``cache_salt``."""
        handoff = self._handoff_for("do P/D transfers")
        request = self._new_request(request_id, prompt_token_ids, sampling, cache_salt, remote_prefill=True)
        handoff.expect(request, peer)
        self._constrain(request)
        return request

    def provide_handle(self, request_id: str, handle: KVHandle) -> RequestOutput | None:
        """The handle of an announced request: start the read into its reserved blocks (or the
        usual path when none were reserved). A request no longer expected: notify the owner
        only. Returns an error output when the request fails here (a handle that does not fit)."""
        if self.handoff is None:  # nothing is announced on an engine without a kv_role
            return None
        self.drain()  # the read may land in blocks an in-flight step still writes (``drain``)
        try:
            ended = self.handoff.provide_handle(request_id, handle)
        except ValueError:  # a handle too late to read with transfer.on_failure=fail: the request ends
            self.runner.forget(request_id)
            raise
        if ended is not None:
            self.runner.forget(request_id)
        return ended

    def discard_handle(self, handle: KVHandle | None) -> None:
        """A handle nobody will read (its request ended here): let its owner free at once."""
        if handle is not None and self.handoff is not None:
            self.handoff.discard_handle(handle)

    def warm_peer(self, peer: AgentInfo) -> bool:
        """Open the connection to a prefill worker's transfer agent now, so the first real read
        from it pays no setup (``PDHandoff.warm_peer``). False if the peer is known already, was
        tried before, or this engine has no ``kv_role``."""
        return self.handoff is not None and self.handoff.warm_peer(peer)

    def export_prefix(self, request_id: str, token_ids: list[int]) -> KVHandle | None:
        """Hold the cached prefix ``token_ids`` for a peer to copy (a pin re-established by
        transfer): a handle like a prefill's, whose blocks stay held until the reader's
        notification or ``transfer.release_timeout_s``. The reader loads it as the decode side
        of P/D does (``add_request(token_ids + [t], ..., kv_handle=handle)``). None when this
        cache no longer serves the whole prefix, or the hold does not fit (the reader computes)."""
        handoff = self._handoff_for("export a prefix")
        assert request_id and token_ids, "a pin's copy names its id and a prefix the driver checked"
        handle = handoff.export_prefix(request_id, list(token_ids))
        self._copy_tiers(wait=True)  # a peer reads the blocks promoted for it, by DMA
        return handle

    @property
    def only_awaiting_handles(self) -> bool:
        """Nothing to poll: every request here waits for a handle, with no read in flight, no
        blocks held for a reader and nothing to compute (the worker may sleep until a call)."""
        if self.scheduler.running or self.scheduler.waiting or self.in_flight is not None:
            return False
        return self.handoff is None or self.handoff.only_awaiting_handles

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Progress transfers, run one scheduled batch, return what each request gained.

        Fault isolation: a row that cannot be sampled fails only its request; a forward that
        raises fails only the requests of that batch (their blocks freed, anything the failed
        step registered in the prefix cache taken out) and the engine goes on. ``EngineBroken``
        is raised only when it cannot go on: its bookkeeping no longer holds, or
        ``MAX_CONSECUTIVE_FAILED_STEPS`` batches in a row failed.

        With ``scheduler.async_scheduling`` a step the runner can launch (``can_launch``: a
        decode-only step, or with the token-bucket step a prefill or mixed one, whose rows
        sample without the host) is launched without waiting for its tokens; while it runs, the
        next call schedules and launches the step after it (``Scheduler.schedule_continuation``:
        the running requests and then admissions, as ``schedule`` would, each request that
        samples in the launched step with a placeholder token whose id is read on the device),
        and only then reads the earlier step's tokens and updates the requests
        (``counters.overlapped_steps``). So the outputs returned lag the device by one step,
        and one step stays in flight between calls while the chain holds; anything else (a
        request that may finish by length, a block to preempt for, a request whose rows need
        the host) ends the chain: the in-flight step is read and the next call schedules as
        usual; an abort or a KV transfer reads it first (``drain``)."""
        results, self._drained = self._drained, []
        handoff = self.handoff
        if handoff is not None:
            for ended in handoff.progress():  # a failed read ends its request: drop its runner state
                if ended.finished:
                    self.runner.forget(ended.request_id)
                results.append(ended)
        scheduler = self.scheduler
        if self.in_flight is None:
            if not (scheduler.running or scheduler.waiting):
                self._copy_tiers()
                return results
            output = scheduler.schedule()
            self.counters.step_prompt_tokens = output.prompt_tokens
            self._copy_tiers()
            if self.on_scheduled is not None:
                self.on_scheduled()
            if not (self.async_scheduling and self.runner.can_launch(output)):
                results.extend(self._run_synchronously(output))
                return results
            try:
                self.in_flight = LaunchedStep(output, self.runner.launch(output))
            except Exception as exc:  # noqa: BLE001 - a failed batch must not stop the engine
                results.extend(self._fail_batch(output, exc))
                return results
        previous, self.in_flight = self.in_flight, None
        following, failed = self._launch_continuation(previous)
        results.extend(self._read(previous))
        if failed is not None:
            results.extend(self._fail_batch(*failed))
        self.in_flight = following
        # the launched step's prompt tokens are being computed (``WorkerView.load``)
        self.counters.step_prompt_tokens = following.output.prompt_tokens if following is not None else 0
        return results

    def _copy_tiers(self, wait: bool = False) -> None:
        """Run the host-tier copies the coordinator queued (offloads of the blocks it evicted,
        promotes of the blocks admissions loaded back), before the next forward touches a block."""
        if self.coordinator.host is not None:
            copies = self.coordinator.take_tier_copies()
            if copies:
                self.runner.copy_tiers(copies, wait)

    def _run_synchronously(self, output: SchedulerOutput) -> list[RequestOutput]:
        try:
            sampled = self.runner.execute(output)
        except Exception as exc:  # noqa: BLE001 - a failed batch must not stop the engine
            return self._fail_batch(output, exc)
        finally:
            self.counters.step_prompt_tokens = 0
        return self._apply(output, sampled)

    def _launch_continuation(
        self, previous: LaunchedStep
    ) -> tuple[LaunchedStep | None, tuple[SchedulerOutput, Exception] | None]:
        """Schedule and launch the step after ``previous`` while ``previous`` may still run:
        (the launched step or None, the scheduled output and why its launch failed or None).

        A request that stops on ``previous``'s token is in this step too; ``update`` frees its
        blocks after this launch. Its writes here (the KV of the stop token, a recurrent state)
        land in blocks it owned at launch, and any later step that reuses those blocks runs
        after this one on the same stream; a KV transfer, which the stream does not order,
        starts only after ``drain``."""
        runner = self.runner
        output = self.scheduler.schedule_continuation(previous.output, runner.launches_mixed, self._launchable)
        if output is None:
            return None, None
        self._copy_tiers()
        if self.on_scheduled is not None:
            self.on_scheduled()
        try:
            launched = LaunchedStep(output, runner.launch(output, previous.tokens))
            self.counters.overlapped_steps += 1
            self.counters.overlapped_prompt_steps += output.prompt_tokens > 0
            return launched, None
        except Exception as exc:  # noqa: BLE001 - a failed batch must not stop the engine
            return None, (output, exc)

    @staticmethod
    def _launchable(request: Request) -> bool:
        """Whether a request may be in a launched step (``ModelRunner.can_launch``'s test of a
        row, which ``Scheduler.schedule_continuation`` applies before it schedules)."""
        return request.sampling.launchable and not request.prefill_only

    def _read(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them (a failure on the device fails the batch)."""
        try:
            sampled = launched.tokens.result()
        except Exception as exc:  # noqa: BLE001 - a failed batch must not stop the engine
            return self._fail_batch(launched.output, exc)
        return self._apply(launched.output, sampled)

    def _apply(self, output: SchedulerOutput, sampled: SampledTokens) -> list[RequestOutput]:
        """A computed step's samples: fail the rows that could not be sampled, update the rest."""
        self.consecutive_failed_steps = 0
        results = []
        for request_id, why in sampled.failures.items():
            if self.scheduler.is_running(request_id):
                results.append(self._fail_request(request_id, why))
        logprobs, prompt_logprobs = sampled.logprobs, sampled.prompt_logprobs
        structured = self.runner.structured
        for result in self.scheduler.update(output, sampled.tokens):
            if result.new_token_ids and result.request_id in structured:
                result = self._advance_grammar(result)
            if logprobs and result.new_token_ids and result.request_id in logprobs:
                result.logprobs = [logprobs[result.request_id]]
            if prompt_logprobs and result.request_id in prompt_logprobs:
                result.prompt_logprobs = prompt_logprobs[result.request_id]
            if result.finished:
                self.runner.forget(result.request_id)
            if result.finish_reason == RequestStatus.FINISHED_REMOTE_DECODE.value:
                assert self.handoff is not None, "a prefill-only request needs a kv_role (add_request checks)"
                result = replace(result, kv_handle=self.handoff.export(result.request_id))
            results.append(result)
        return results

    def _advance_grammar(self, result: RequestOutput) -> RequestOutput:
        """A constrained request's new token advances its matcher: a finished grammar stops the
        request (``stop``: the model's EOS ended it, or nothing but EOS may follow, or the model
        has no EOS and the output is a whole match); a token the grammar refuses fails it."""
        request_id = result.request_id
        token = result.new_token_ids[-1]
        structured = self.runner.structured
        if not structured.accept(request_id, token):
            if result.finished:  # it ended on this token anyway; its output stands as sampled
                return result
            return self._fail_request(request_id, f"structured output: token {token} does not fit the grammar")
        if result.finished or not structured.is_terminated(request_id):
            return result
        self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)
        return replace(result, finished=True, finish_reason=RequestStatus.FINISHED_STOPPED.value)

    def drain(self) -> None:
        """Read the in-flight step now (its outputs come with the next ``step``), so that no
        step the engine launched still runs: before an abort, and before a KV transfer starts
        into blocks (a transfer is not ordered after the device's work)."""
        launched, self.in_flight = self.in_flight, None
        if launched is not None:
            self._drained.extend(self._read(launched))

    def _fail_batch(self, output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        self.consecutive_failed_steps += 1
        self.counters.failed_steps += 1
        why = f"engine step failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.error("%s: %s (%d requests in the batch)", self.name, why, len(output.chunks), exc_info=exc)
        results = []
        for chunk in output.chunks:
            request_id = chunk.request.request_id
            if not self.scheduler.is_running(request_id):  # it ended on an earlier step's token
                continue
            self.coordinator.discard_uncomputed(request_id, chunk.start)
            results.append(self._fail_request(request_id, why))
        if self.runner.leader is not None:  # the other ranks may wait in a collective this step never reached
            raise EngineBroken(f"{self.name}: a step of the split worker failed; its ranks no longer agree") from exc
        try:
            self.coordinator.check_invariants()
        except Exception as broken:  # noqa: BLE001 - any failed check means the cache is inconsistent
            raise EngineBroken(f"{self.name}: KV cache inconsistent after a failed step ({broken})") from exc
        if self.consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineBroken(f"{self.name}: {self.consecutive_failed_steps} steps in a row failed ({why})") from exc
        return results

    def _fail_request(self, request_id: str, why: str) -> RequestOutput:
        """End one request with ``finish_reason="error"``, freeing its blocks."""
        self.counters.failed_requests += 1
        self.runner.forget(request_id)
        self.scheduler.finish(request_id, RequestStatus.FINISHED_ERROR)
        return RequestOutput(request_id, [], True, RequestStatus.FINISHED_ERROR.value, error=why)

    # -- state -------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Anything outstanding: requests to compute, a step in flight or outputs to return,
        reads in flight, or blocks held for readers."""
        return (
            self.scheduler.has_work
            or self.in_flight is not None
            or bool(self._drained)
            or (self.handoff is not None and self.handoff.has_work)
        )

    @property
    def has_compute_work(self) -> bool:
        """Requests the next ``step`` will run the model for, or a launched step it will read."""
        scheduler = self.scheduler
        return bool(scheduler.running or scheduler.waiting or self._drained) or self.in_flight is not None

    def take_events(self) -> list[KVEvent]:
        """KV events (stored / removed / pinned / ...) since the last call, for the router."""
        return self.coordinator.take_events()

    def close(self) -> None:
        """Release the decode graphs and the transfer registration (pending reads are cancelled).
        Idempotent."""
        self.drain()
        self.runner.close()
        if self.transfer is not None:
            self.transfer.close()
