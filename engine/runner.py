"""ModelRunner: owns the model and its KV slot tensors; SchedulerOutput -> forward -> tokens.

The slot tensors (``[num_blocks_p, page_bytes_p]`` bytes each for every slot of every pool
``p``, see ``engine.model.kv_layout``) are the only KV memory of the worker; attention layers get
typed views of their slot in the attention pool, recurrent layers fp32 views of their slot in a
state pool, and the transfer layer registers the raw slots (with the pool of each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.kv_cache.spec import MambaSpec
from engine.model.arch import ModelArch
from engine.model.bamba import BambaLM
from engine.model.batch import (
    ChunkSpec,
    ForwardBatch,
    build_group_index,
    build_state_index,
)
from engine.model.decoder import CausalLM
from engine.model.kv_layout import KVLayout
from engine.model.recurrent import RecurrentMixer, cache_users
from engine.model.triton_attention import enabled as triton_attention_enabled
from engine.sampler import SampledTokens, Sampler
from engine.scheduler import SchedulerOutput

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        model: CausalLM | BambaLM,
        num_blocks: int | Sequence[int],
        device: torch.device,
        dtype: str,
        allocate_slots: Callable[[list[int], list[int], str], list[torch.Tensor]] | None = None,
    ):
        """``num_blocks``: blocks per pool (an int: every pool alike). ``allocate_slots(rows per
        slot, page bytes per slot, device)`` supplies the slot memory (a transfer backend's)."""
        layout.check_invariants(arch)
        self.arch = arch
        self.layout = layout
        self.model = model
        self.device = device
        self.paged_attention = triton_attention_enabled(device)  # attention kernels read KV in place
        self.dtype = TORCH_DTYPES[dtype]
        counts = [num_blocks] * layout.num_pools if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != layout.num_pools:
            raise ValueError(f"num_blocks: {len(counts)} values for {layout.num_pools} pools")
        self.pool_blocks = tuple(counts)
        self.num_blocks = counts[0]
        rows = [counts[p] for p in layout.slot_pool]
        pages = list(layout.slot_page_bytes)
        if allocate_slots is not None:  # a transfer backend's memory (shared / registered)
            self.slots = allocate_slots(rows, pages, str(device))
        else:
            self.slots = [torch.zeros(n, page, dtype=torch.uint8, device=device) for n, page in zip(rows, pages)]
        for index, layer in enumerate(model.model.layers):
            for user in cache_users(layer):
                slot = self.slots[layout.slot_index(layout.layer_pool[index], layout.layer_slot[index])]
                if isinstance(user, RecurrentMixer):
                    user.bind_state(slot.view(torch.float32))
                else:
                    user.bind_cache(slot, layout.block_size)
        self.windows = [getattr(group.spec, "window", None) for group in layout.groups]
        self.is_mamba = [isinstance(group.spec, MambaSpec) for group in layout.groups]
        self.sampler = Sampler(device)
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        # set after each forward on CUDA: the KV and state writes queued so far are done once it is
        self._kv_written: torch.cuda.Event | None = None

    def execute(self, output: SchedulerOutput) -> SampledTokens:
        """Run the scheduled chunks; return the sampled token of every chunk that samples (and
        the requests whose row could not be sampled). A failed forward raises."""
        return self._run(output)[0]

    def logits_for(self, output: SchedulerOutput) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        """Like ``execute`` but also returns each sampled row's logits, on the CPU (for oracles)."""
        sampled, logits = self._run(output)
        if sampled.failures:
            raise RuntimeError(f"sampling failed: {sampled.failures}")
        return sampled.tokens, {rid: row.cpu() for rid, row in logits.items()}

    @torch.inference_mode()
    def _run(self, output: SchedulerOutput) -> tuple[SampledTokens, dict[str, torch.Tensor]]:
        sampling = [c for c in output.chunks if c.sample]
        if not output.chunks:
            return SampledTokens(), {}
        batch = self.build_batch(output)
        hidden = self.model(batch)
        if self.device.type == "cuda":
            self._kv_written = torch.cuda.Event()
            self._kv_written.record()
        if not sampling:
            return SampledTokens(), {}
        logits = self.model.logits(hidden[batch.sample_indices])
        ids = [c.request.request_id for c in sampling]
        sampled = self.sampler.sample(logits, ids, [c.request.sampling for c in sampling])
        return sampled, dict(zip(ids, logits, strict=True))

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
            self._scratch = tuple(torch.empty(size, dtype=self.dtype, device=self.device) for _ in range(2))  # type: ignore[assignment]
        return self._scratch  # type: ignore[return-value]

    def build_batch(self, output: SchedulerOutput) -> ForwardBatch:
        chunks: list[ChunkSpec] = []
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        offset = 0
        for chunk in output.chunks:
            tokens = chunk.request.token_ids[chunk.start : chunk.start + chunk.num_tokens]
            chunks.append(ChunkSpec(offset, chunk.start, chunk.num_tokens))
            input_ids.extend(tokens)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            offset += chunk.num_tokens
            if chunk.sample:
                sample_rows.append(offset - 1)
        decode = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        prefill = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
        groups = [
            build_state_index(chunks, [chunk.block_ids[g] for chunk in output.chunks], self.layout.block_size)
            if self.is_mamba[g]
            else build_group_index(
                chunks,
                [chunk.block_ids[g] for chunk in output.chunks],
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
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            chunks=chunks,
            prefill_chunks=prefill,
            decode_chunks=decode,
            groups=groups,
            sample_indices=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
        )
