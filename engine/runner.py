"""ModelRunner: owns the model and its KV slot tensors; SchedulerOutput -> forward -> tokens.

The slot tensors (``[num_blocks_p, page_bytes_p]`` bytes each for every slot of every pool
``p``, see ``engine.model.kv_layout``) are the only KV memory of the worker; attention layers get
typed views of their slot in the attention pool, recurrent layers fp32 views of their slot in a
state pool, and the transfer layer registers the raw slots (with the pool of each).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from engine.host_kv import HostKVMemory
from engine.kv_cache.coordinator_types import per_pool
from engine.kv_cache.host_tier import TierCopy
from engine.kv_cache.spec import MambaSpec
from engine.logprobs import TokenLogprob
from engine.model.arch.model_arch import ModelArch
from engine.model.batch import (
    ChunkSpec,
    ForwardBatch,
    build_group_index,
    build_state_index,
)
from engine.model.checkpoints.loader import LanguageModel
from engine.model.decode_step import DecodeGroups, DecodeStep
from engine.model.kernels.triton_attention import enabled as triton_attention_enabled
from engine.model.kv_layout import KVLayout
from engine.model.layers.recurrent import RecurrentMixer, cache_users
from engine.model.mixed_step import MixedStep, StepChunk, placeholder_id
from engine.rank_group import ChunkInputs, RankLeader
from engine.request import Request
from engine.sampler import PendingTokens, SampledTokens, Sampler
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.structured_output import StructuredOutputs
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NO_LOGITS = torch.empty(0)


def _no_tokenizer() -> Tokenizer:
    raise ValueError("structured: this model runner was built without its tokenizer, so it constrains nothing")


def decode_groups(windows: list[int | None], is_mamba: list[bool]) -> DecodeGroups:
    """The groups as a decode step feeds them: attention (with windows) and recurrent, from the
    runner's per-group ``windows`` and ``is_mamba``."""
    attention = tuple(g for g, mamba in enumerate(is_mamba) if not mamba)
    return DecodeGroups(
        attention=attention,
        windows=tuple(windows[g] for g in attention),
        recurrent=tuple(g for g, mamba in enumerate(is_mamba) if mamba),
        num_groups=len(is_mamba),
    )


def graphs_supported(arch: ModelArch, device: torch.device, paged_attention: bool) -> bool:
    """Whether a decode step of ``arch`` can be captured as a CUDA graph on ``device``: CUDA, the
    Triton attention path where the model has attention (the torch path's gathers change shape
    with the context), and no sparse MoE layer (its expert dispatch reads counts on the host)."""
    if device.type != "cuda":
        return False
    has_attention = any(layer.kind in ("full_attention", "sliding_attention") for layer in arch.layers)
    has_moe = arch.moe is not None or any(layer.moe for layer in arch.layers)
    return (paged_attention or not has_attention) and not has_moe


def _capture_or_run_uncaptured(step: DecodeStep | MixedStep, name: str) -> None:
    """Capture ``step``'s graphs; a failed capture drops them and the worker still serves, its
    ``name`` steps running from the same static buffers uncaptured."""
    try:
        step.capture()
    except RuntimeError as exc:
        log.error("%s-step graph capture failed, those steps run uncaptured from the static buffers: %s", name, exc)
        step.drop_graphs()


class ModelRunner:
    """Runs one step of the model over a batch of request chunks.

    Invariant: ``slots[layout.slot_index(p, j)]`` row ``b`` is block ``b`` of pool ``p``: the
    page of the ``j``-th layer of the group (of pool ``p``) that owns that block; slot tensors of
    different pools never overlap; nothing else writes KV memory (except a transfer into blocks
    the coordinator handed to it).
    """

    def __init__(
        self,
        arch: ModelArch,
        layout: KVLayout,
        model: LanguageModel,
        num_blocks: int | Sequence[int],
        device: torch.device,
        dtype: str,
        allocate_slots: Callable[[list[int], list[int], str], list[torch.Tensor]] | None = None,
        *,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        cuda_graphs: bool = False,
        structured: StructuredOutputs | None = None,
        host_blocks: Sequence[int] | None = None,
    ):
        """``num_blocks``: blocks per pool (an int: every pool alike). ``allocate_slots(rows per
        slot, page bytes per slot, device)`` supplies the slot memory (a transfer backend's).
        ``max_num_seqs`` and ``max_model_len`` (both or neither) size the static decode step
        (``engine.model.decode_step``; without them decode-only steps run eagerly);
        ``max_num_batched_tokens`` sizes the static token-bucket step of every other step
        (``engine.model.mixed_step``; without it they run eagerly, counted in ``eager_steps``).
        ``cuda_graphs`` captures both as CUDA graphs (the mixed step piecewise), where the device
        and the model allow it (``graphs_supported``). ``structured``: the grammars of
        constrained requests (their token masks apply to the rows they sample); None: the model
        constrains nothing.
        ``host_blocks``: blocks of each pool's host pool (``kv_cache.offload``; None: no host tier)."""
        layout.check_invariants(arch)
        self.arch = arch
        self.layout = layout
        self.model = model
        self.device = device
        self.paged_attention = triton_attention_enabled(device)  # attention kernels read KV in place
        self.dtype = TORCH_DTYPES[dtype]
        counts = per_pool("num_blocks", num_blocks, layout.num_pools)
        self.pool_blocks = tuple(counts)
        self.num_blocks = counts[0]
        rows = [counts[p] for p in layout.slot_pool]
        pages = list(layout.slot_page_bytes)
        if allocate_slots is not None:  # a transfer backend's memory (shared / registered)
            self.slots = allocate_slots(rows, pages, str(device))
        else:
            self.slots = [
                torch.zeros(n, page, dtype=torch.uint8, device=device) for n, page in zip(rows, pages, strict=True)
            ]
        rope_tables: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}  # the fused path's, one per rotary type
        for index, layer in enumerate(model.model.layers):
            for user in cache_users(layer):
                slot = self.slots[layout.slot_index(layout.layer_pool[index], layout.layer_slot[index])]
                if isinstance(user, RecurrentMixer):
                    user.bind_state(slot.view(torch.float32))
                    continue
                user.bind_cache(slot, layout.block_size)
                if max_model_len is not None:
                    user.bind_rope_table(max_model_len, rope_tables)
        self.host_kv = HostKVMemory(layout, self.slots, host_blocks) if host_blocks is not None else None
        self.windows = [getattr(group.spec, "window", None) for group in layout.groups]
        self.is_mamba = [isinstance(group.spec, MambaSpec) for group in layout.groups]
        self.sampler = Sampler(device)
        self.structured = (
            structured
            if structured is not None
            else StructuredOutputs(_no_tokenizer, arch.vocab_size, arch.eos_token_ids)
        )
        # prompt logprobs of requests whose prompt is being computed (``Request.scores_prompt``),
        # collected chunk by chunk and handed out with the request's first token
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        #: rank 0 of a tensor-parallel worker: sends each step's inputs to the other ranks
        #: (``engine.rank_group.lead_ranks``); None on one rank, and on the other ranks
        self.leader: RankLeader | None = None
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        # set after each forward on CUDA: the KV and state writes queued so far are done once it is
        self._kv_written: torch.cuda.Event | None = None
        self.decode: DecodeStep | None = None
        self.mixed: MixedStep | None = None
        #: steps run by the eager forward over a freshly built ForwardBatch (``_run``): neither the
        #: static decode step nor the static mixed step took them
        self.eager_steps = 0
        # pinned buffers the sampled ids of launched steps are copied into, taking turns: a step's
        # is rewritten two launches later, after the engine read it (CUDA only)
        self._sampled_hosts: list[torch.Tensor] = []
        self._sampled_turn = 0
        if max_num_seqs is not None and max_model_len is not None:
            if device.type == "cuda":
                self._sampled_hosts = [torch.zeros(max_num_seqs, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self.decode = DecodeStep(
                decode_groups(self.windows, self.is_mamba),
                layout.block_size,
                max_num_seqs,
                max_model_len,
                device,
                self.paged_attention,
                self._forward,
            )
            if cuda_graphs and graphs_supported(arch, device, self.paged_attention):
                _capture_or_run_uncaptured(self.decode, "decode")
        if max_num_batched_tokens is not None:
            self.mixed = MixedStep(
                max_num_batched_tokens,
                len(layout.groups),
                layout.block_size,
                device,
                self._forward,
                [user for layer in model.model.layers for user in cache_users(layer)],
                self.index_batch,
            )
            if cuda_graphs and graphs_supported(arch, device, self.paged_attention):
                _capture_or_run_uncaptured(self.mixed, "mixed")

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The forward the static steps run: whatever ``model`` is now (a wrapper put there later
        serves them too)."""
        return self.model(batch)

    def close(self) -> None:
        """Release the decode step's graphs now (their memory pool and the buffers they read),
        rather than whenever the garbage collector reaches them. Idempotent."""
        if self.decode is not None:
            self.decode.drop_graphs()
        if self.mixed is not None:
            self.mixed.drop_graphs()

    def forget(self, request_id: str) -> None:
        """Drop what the runner keeps for a request that left (its prompt logprobs, its grammar
        matcher, its decode slot)."""
        self._prompt_logprobs.pop(request_id, None)
        self.structured.forget(request_id)
        if self.decode is not None:
            self.decode.release(request_id)

    def copy_tiers(self, copies: list[TierCopy], wait: bool = False) -> None:
        """Run the host tier's queued copies, in order, before any later forward reads or writes
        a block (``HostKVMemory.run``); ``wait``: until they are done (a transfer, which no stream
        orders, may touch those blocks next)."""
        host_kv = self.host_kv
        assert host_kv is not None, "copies come only from a coordinator with a host tier"
        if self.leader is not None:
            self.leader.send_copies(copies)
        host_kv.run(copies)
        if wait and host_kv.stream is not None:
            host_kv.stream.synchronize()

    def execute(self, output: SchedulerOutput) -> SampledTokens:
        """Run the scheduled chunks; return the sampled token of every chunk that samples (and
        the requests whose row could not be sampled). A failed forward raises."""
        return self._run(output)[0]

    def logits_for(self, output: SchedulerOutput) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        """Like ``execute`` but also returns each sampled row's logits, on the CPU (for oracles)."""
        sampled, logits = self._run(output)
        if sampled.failures:
            raise RuntimeError(f"sampling failed: {sampled.failures}")
        ids = [c.request.request_id for c in output.chunks if c.sample]
        return sampled.tokens, dict(zip(ids, logits.cpu(), strict=True))

    @property
    def launches_mixed(self) -> bool:
        """Whether ``launch`` takes prefill and mixed steps too (the token-bucket step exists and
        no other rank must run the same step)."""
        return self.mixed is not None and self.leader is None

    def can_launch(self, output: SchedulerOutput) -> bool:
        """Whether ``launch`` takes this step: one the static decode step or (``launches_mixed``)
        the token-bucket step runs, whose sampled rows the sampler can sample before the host
        knows their last token (``launchable``), with no prefill-only request (its hand-off
        reads its pages once the step is read)."""
        chunks = output.chunks
        if not chunks or not self.sampler.all_launchable(c.request for c in chunks):
            return False
        if any(c.request.prefill_only for c in chunks):
            return False
        if self.decode is not None and self.decode.accepts(chunks):
            return True
        return self.launches_mixed and self.mixed is not None and self.mixed.accepts(output.num_tokens)

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput, previous: PendingTokens | None = None) -> PendingTokens:
        """Start a step (``can_launch``) and return without waiting for its tokens: they stay on
        the device (the next step may read them there) and come to the host by a non-blocking
        copy that ``PendingTokens.result`` waits for. ``previous``: the launched step before,
        whose sampled ids are the input ids of this step's placeholder tokens (a chunk starting
        at the end of its request's known tokens, ``Scheduler.schedule_continuation``); every
        other input id is known on the host. Samples exactly as ``execute`` does. A forward that
        fails on the host raises here; on CUDA a failing kernel raises at ``result``."""
        chunks = output.chunks
        previous_ids = previous.ids if previous is not None else None
        rows = self._placeholder_rows(chunks, previous)
        decode = self.decode
        if decode is not None and decode.accepts(chunks):
            sampling = chunks  # a decode-only step samples every chunk
            if previous_ids is None or all(row < 0 for row in rows):
                hidden = decode.run(chunks)
            else:
                hidden = decode.run(chunks, previous_ids, rows)
        else:
            mixed = self.mixed
            if mixed is None or not self.launches_mixed:
                raise RuntimeError("launch: only the static decode and token-bucket steps are launched")
            sampling = [c for c in chunks if c.sample]
            inputs = self.step_inputs(output, rows)
            placeholders = previous_ids if any(row >= 0 for row in rows) else None
            hidden, batch = mixed.run(inputs, placeholders)
            if sampling:
                hidden = hidden[batch.sample_indices]
        self._record_kv_written()
        request_ids = [c.request.request_id for c in sampling]
        if sampling:
            logits = self.model.logits(hidden)
            ids, failures = self.sampler.sample_on_device(logits, [c.request for c in sampling])
        else:
            ids, failures = torch.empty(0, dtype=torch.long, device=self.device), {}
        host = None
        if self._sampled_hosts:
            self._sampled_turn ^= 1
            host = self._sampled_hosts[self._sampled_turn]
        return PendingTokens(request_ids, ids, failures, host)

    @staticmethod
    def _placeholder_rows(chunks: Sequence[ScheduledChunk], previous: PendingTokens | None) -> list[int]:
        """Per chunk: the row of ``previous``'s sampled ids holding its input token when that
        token is a placeholder (the chunk starts at the end of the known tokens), else -1."""
        row_of = {request_id: row for row, request_id in enumerate(previous.request_ids)} if previous else {}
        rows = []
        for chunk in chunks:
            if chunk.start < len(chunk.request.token_ids):
                rows.append(-1)
                continue
            if chunk.request.request_id not in row_of:
                raise RuntimeError(f"launch: {chunk.request.request_id}'s input token comes from no launched step")
            rows.append(row_of[chunk.request.request_id])
        return rows

    def _record_kv_written(self) -> None:
        if self.device.type == "cuda":
            self._kv_written = torch.cuda.Event()
            self._kv_written.record()

    @torch.inference_mode()
    def _run(self, output: SchedulerOutput) -> tuple[SampledTokens, torch.Tensor]:
        """Sampled tokens and the logits of the sampled rows (in chunk order)."""
        chunks = output.chunks
        if not chunks:
            return SampledTokens(), _NO_LOGITS
        if self.decode is not None and self.decode.accepts(chunks):
            sampling = chunks  # a decode-only step samples every chunk
            hidden = self.decode.run(chunks)
        else:
            sampling = [c for c in chunks if c.sample]
            inputs = self.step_inputs(output)
            mixed = self.mixed
            # a split worker's other ranks run the unpadded step: rank 0 must run the same shapes
            if mixed is not None and self.leader is None and mixed.accepts(sum(c.num_tokens for c in chunks)):
                hidden, batch = mixed.run(inputs)
            else:
                if self.leader is not None:
                    self.leader.send_step(inputs)
                batch = self.batch_of(inputs)
                hidden = self.model(batch)
                self.eager_steps += 1
            for chunk, given, spec in zip(chunks, inputs, batch.chunks[: len(inputs)], strict=True):
                if given.score_targets is not None:
                    self._score_prompt(chunk.request, given, hidden[spec.offset : spec.offset + spec.num_tokens])
            if sampling:
                hidden = hidden[batch.sample_indices]
        self._record_kv_written()
        if not sampling:
            return SampledTokens(), _NO_LOGITS
        logits = self.model.logits(hidden)
        # the sampled rows' structured-output masks (None: no row is constrained); ``can_launch``
        # keeps constrained rows out of launched steps, so only this path applies them
        structured = self.structured
        allowed = structured.mask([c.request.request_id for c in sampling]) if len(structured) else None
        sampled = self.sampler.sample(logits, [c.request for c in sampling], allowed)
        if self._prompt_logprobs:
            for chunk in sampling:
                request = chunk.request
                scored = self._prompt_logprobs.pop(request.request_id, None) if request.scores_prompt else None
                if scored is not None and request.request_id in sampled.tokens:
                    sampled.prompt_logprobs[request.request_id] = scored
        return sampled, logits

    def _score_prompt(self, request: Request, chunk: ChunkInputs, hidden: torch.Tensor) -> None:
        """Collect the prompt logprobs a prefill chunk of a ``scores_prompt`` request computes:
        position ``p`` predicts prompt token ``p + 1`` (``chunk.score_targets``)."""
        scored = self._prompt_logprobs.setdefault(request.request_id, [None] * request.prompt_len)
        targets = chunk.score_targets
        if not targets:
            return
        begin = chunk.start + 1
        found = self.sampler.prompt_logprobs(hidden[: len(targets)], targets, chunk.score_k, self.model.logits)
        scored[begin : begin + len(targets)] = found

    @torch.inference_mode()
    def follow_step(self, chunks: list[ChunkInputs]) -> None:
        """A tensor-parallel follower's part of a step rank 0 runs (``engine.rank_group``): the
        same forward over this rank's shard, the same prompt scoring and logits of the sampled
        rows (their sums and gathers meet rank 0's), with nothing sampled or kept."""
        if not chunks:
            return
        batch = self.batch_of(chunks)
        hidden = self.model(batch)
        for chunk, spec in zip(chunks, batch.chunks, strict=True):
            if chunk.score_targets:
                rows = hidden[spec.offset : spec.offset + len(chunk.score_targets)]
                self.sampler.prompt_logprobs(rows, chunk.score_targets, chunk.score_k, self.model.logits)
        if any(chunk.sample for chunk in chunks):
            self.model.logits(hidden[batch.sample_indices])
        self._record_kv_written()

    def wait_kv_written(self) -> None:
        """Block until every KV page and recurrent state the last forward wrote is in memory.

        On CUDA a step that samples nothing (a prefill-only step) returns while its writes are
        still queued on the stream; a reader that copies the pages by DMA (NIXL, CUDA IPC) is not
        ordered after them. Call this before a handle naming those pages leaves the engine."""
        if self._kv_written is not None:
            self._kv_written.synchronize()

    def _scratch_for(self, groups: list) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V gather buffers large enough for this step's biggest read, grown and then reused."""
        rows = 0
        for index in groups:
            for _, blocks, _, _ in index.prefill_reads:
                rows = max(rows, blocks.numel())
            if index.decode_block is not None:
                rows = max(rows, index.decode_block.numel())
        size = rows * self.arch.num_kv_heads * self.arch.head_dim
        if self._scratch is None or self._scratch[0].numel() < size:
            size = max(size, 1) * 5 // 4  # headroom: sequences grow every step
            self._scratch = (
                torch.empty(size, dtype=self.dtype, device=self.device),
                torch.empty(size, dtype=self.dtype, device=self.device),
            )
        return self._scratch

    @staticmethod
    def step_inputs(output: SchedulerOutput, placeholder_rows: Sequence[int] = ()) -> list[ChunkInputs]:
        """What each scheduled chunk means to the forward (``ChunkInputs``): the same on every
        tensor-parallel rank. ``placeholder_rows`` (a launched step's, ``_placeholder_rows``):
        a chunk whose entry ``r`` is not negative has a placeholder input token, given as
        ``placeholder_id(r)`` for the token-bucket step to resolve on the device."""
        inputs = []
        for i, chunk in enumerate(output.chunks):
            request = chunk.request
            start, end = chunk.start, chunk.start + chunk.num_tokens
            targets = None
            k = 0
            if request.scores_prompt:
                # position p predicts prompt token p + 1 (the first prompt token has none)
                count = max(0, min(chunk.num_tokens, request.prompt_len - 1 - start))
                targets = request.token_ids[start + 1 : start + 1 + count]
                k = request.sampling.prompt_logprobs or 0
            tokens = request.token_ids[start:end]
            if placeholder_rows and placeholder_rows[i] >= 0:
                tokens = [placeholder_id(placeholder_rows[i])]
            inputs.append(ChunkInputs(tokens, start, chunk.block_ids, chunk.sample, targets, k))
        return inputs

    def build_batch(self, output: SchedulerOutput) -> ForwardBatch:
        """The eager step's inputs (the steps neither static step takes, ``eager_steps``)."""
        return self.batch_of(self.step_inputs(output))

    def batch_of(self, given: Sequence[StepChunk]) -> ForwardBatch:
        """The eager forward's batch over ``given`` chunks."""
        input_ids: list[int] = []
        positions: list[int] = []
        for chunk in given:
            input_ids.extend(chunk.tokens)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
        return self.index_batch(
            given,
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
        )

    def index_batch(self, given: Sequence[StepChunk], input_ids: torch.Tensor, positions: torch.Tensor) -> ForwardBatch:
        """The step's batch over ``given`` chunks whose flattened ids and positions (on the device)
        are ``input_ids`` and ``positions``: the chunk layout and each group's index."""
        chunks: list[ChunkSpec] = []
        sample_rows: list[int] = []
        tables = [chunk.block_ids for chunk in given]
        offset = 0
        for chunk in given:
            chunks.append(ChunkSpec(offset, chunk.start, chunk.num_tokens))
            offset += chunk.num_tokens
            if chunk.sample:
                sample_rows.append(offset - 1)
        decode = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        prefill = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
        groups = [
            build_state_index(chunks, [table[g] for table in tables], self.layout.block_size)
            if self.is_mamba[g]
            else build_group_index(
                chunks,
                [table[g] for table in tables],
                self.layout.block_size,
                self.windows[g],
                prefill,
                decode,
                self.device,
                paged=self.paged_attention,
            )
            for g in range(len(self.layout.groups))
        ]
        return ForwardBatch(
            scratch=self._scratch_for(groups),
            input_ids=input_ids,
            positions=positions,
            chunks=chunks,
            prefill_chunks=prefill,
            decode_chunks=decode,
            groups=groups,
            sample_indices=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
        )
