"""MixedStep: prefill and mixed prefill + decode steps from a static, token-bucket-padded buffer,
replayed on CUDA as piecewise graphs split at the mixers.

A step the decode step does not take (``engine.model.decode_step``: any step with a prompt chunk)
is padded to a *token bucket* (on CUDA 16, 32, 64 ... 1024, then every 1024; on the CPU, which
captures nothing, every multiple of 16; and the scheduler's ``max_num_batched_tokens``) when that
bucket replays a captured graph: its
input ids and positions go into fixed buffers (one host staging buffer, pinned on CUDA, uploaded
by one non-blocking copy; on the CPU the forward reads the staging buffer itself), and the tokens
past the step's are one *pad chunk*: token 0 at positions ``0 ..`` in every group's null block
(its block table holds only block 0, id 0 of every pool, never read for a real token), sampling
nothing, so its K/V and recurrent state go only to the
null block and its rows are dropped. The per-chunk metadata (``ForwardBatch``'s chunks and group
indices, pad chunk included) is built for each step by the runner's builder, as for an eager
step: its shapes follow the chunk structure.

On CUDA each bucket's forward is captured once as *pieces* (vLLM's piecewise design): the capture
ends the current graph where a mixer (an ``Attention`` or ``RecurrentMixer`` module, the modules
that read the cache and the chunk metadata) is called, runs the mixer outside the capture and
starts the next graph after it. What a mixer receives (its hidden-state input, the rotary cos/sin
a piece computed from the static positions) lives at addresses the graphs own; its output is a
fixed tensor the next piece reads. A replay is: piece 0, then for each mixer its eager call on
those same inputs with the live step's ``ForwardBatch``, its result copied into its fixed output,
then the next piece. Dense work (embedding, norms, MLPs, residuals, the final norm) is replayed;
the mixers, whose shapes depend on the chunk structure, run eagerly. Uncaptured (on the CPU, or
after a failed capture: ``drop_graphs`` leaves every step so, served still) a step runs eagerly
from the same fixed buffers and metadata builder but is not padded: padding buys nothing without
a graph, and on the tiny CPU presets the pad chunk made a short prompt's step a quarter dearer
(its tokens, and a second chunk in every group's metadata and every attention call).
``pad_uncaptured`` pads those steps too, so tests on the CPU exercise the buckets, the pad chunk
and its metadata.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from engine.model.batch import ForwardBatch

log = logging.getLogger(__name__)

NULL_BLOCK = 0  # the null block's id in every pool (engine.kv_cache.block_pool takes block 0)
SMALLEST_BUCKET = 16
POW2_UP_TO = 1024  # buckets double up to here, then grow by this much


def token_buckets(max_tokens: int, doubling: bool) -> tuple[int, ...]:
    """Token counts a mixed step is padded to, and ``max_tokens`` itself (every count up to it
    has a bucket). ``doubling`` (CUDA, where each bucket is captured): 16, 32, ... 1024, then
    multiples of 1024; else (the CPU, where a bucket costs nothing but its padding) every
    multiple of 16."""
    sizes = {max_tokens}
    size = SMALLEST_BUCKET
    while size < max_tokens:
        sizes.add(size)
        size = size * 2 if doubling and size < POW2_UP_TO else size + (POW2_UP_TO if doubling else SMALLEST_BUCKET)
    return tuple(sorted(sizes))


def placeholder_id(row: int) -> int:
    """How a step's input buffer holds a *placeholder* token (one the host does not know yet,
    ``Scheduler.schedule_continuation``): ``-(row + 1)``, ``row`` being the row of the previous
    launched step's sampled ids that holds it (real ids are never negative)."""
    return -(row + 1)


def resolve_placeholders(ids: torch.Tensor, previous_ids: torch.Tensor) -> None:
    """Replace, on the device and in place, each placeholder in ``ids`` (``placeholder_id``) by
    the id it names in ``previous_ids`` (a failed row's negative id is read as token 0: its
    request fails and the row's output is dropped); every other id stays."""
    rows = (-ids - 1).clamp_(min=0)
    found = previous_ids.index_select(0, rows).clamp_(min=0) if previous_ids.numel() else torch.zeros_like(ids)
    ids.copy_(torch.where(ids < 0, found, ids))


class StepChunk(Protocol):
    """One chunk of a step as the forward sees it (``engine.rank_group.ChunkInputs`` is one):
    ``tokens`` at positions ``start ..``, its block table per KV group, whether it samples."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def start(self) -> int: ...

    @property
    def block_ids(self) -> list[list[int]]: ...

    @property
    def sample(self) -> bool: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class PadChunk:
    """The pad chunk of a padded step (``MixedStep.pad_chunk``): a ``StepChunk`` that samples
    nothing, scores nothing and reads and writes only null blocks."""

    tokens: list[int]
    start: int
    block_ids: list[list[int]]
    sample: bool = False
    score_targets: None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


#: the runner's metadata builder: (chunks, input ids, positions) -> the step's ForwardBatch
IndexBuilder = Callable[[Sequence[StepChunk], torch.Tensor, torch.Tensor], ForwardBatch]


@dataclass
class MixerCall:
    """One mixer call of a captured bucket: the bound forward, the arguments it got at capture
    (graph-owned tensors, and the capture's ForwardBatch, replaced by the live one at replay),
    and the fixed tensor the next piece reads its output from."""

    forward: Callable[..., torch.Tensor]
    args: tuple
    kwargs: dict[str, object]
    output: torch.Tensor

    def run(self, batch: ForwardBatch) -> None:
        args = tuple(batch if isinstance(arg, ForwardBatch) else arg for arg in self.args)
        kwargs = {k: batch if isinstance(v, ForwardBatch) else v for k, v in self.kwargs.items()}
        self.output.copy_(self.forward(*args, **kwargs))


class PiecewiseGraph:
    """One bucket's captured forward: ``pieces[i]`` replays the dense work before mixer ``i``
    (the last piece: after the last mixer, up to the final norm), ``calls[i]`` runs mixer ``i``
    eagerly. Invariant: ``len(pieces) == len(calls) + 1``; every tensor a piece or call reads
    stays referenced here, so its address never moves."""

    def __init__(self, pieces: list[torch.cuda.CUDAGraph], calls: list[MixerCall], hidden: torch.Tensor):
        assert len(pieces) == len(calls) + 1, "a piece before every mixer and one after the last"
        self.pieces = pieces
        self.calls = calls
        self.hidden = hidden

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        self.pieces[0].replay()
        for call, piece in zip(self.calls, self.pieces[1:], strict=True):
            call.run(batch)
            piece.replay()
        return self.hidden


class PieceCapture:
    """Captures one forward as pieces split at the mixers' calls (``PiecewiseGraph``): between
    ``begin`` and ``restore``, each mixer's forward is replaced (an instance attribute over the class's method)
    by ``split``, which ends the graph being captured, runs the mixer outside it, and begins
    the next graph in the same pool. Owns the mixers' replaced forwards until ``restore``."""

    def __init__(self, mixers: Sequence[nn.Module], pool: torch.cuda._POOL_HANDLE, outputs: list[torch.Tensor]):
        """``outputs``: mixer ``i``'s fixed output buffer (shared by every bucket, a view of its
        first rows; buckets never replay at once), grown here when missing or too small."""
        self.mixers = list(mixers)
        self.pool = pool
        self.outputs = outputs
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[MixerCall] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        for mixer in self.mixers:
            original = mixer.forward

            def split(
                *args: object, _original: Callable[..., torch.Tensor] = original, **kwargs: object
            ) -> torch.Tensor:
                return self.split(_original, args, kwargs)

            mixer.forward = split  # restored by ``restore`` (an instance attribute over the method)
        self._begin_graph()

    def _begin_graph(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def _end_graph(self) -> None:
        graph, self.graph = self.graph, None
        assert graph is not None, "no graph is being captured"
        graph.capture_end()
        self.pieces.append(graph)

    def split(self, forward: Callable[..., torch.Tensor], args: tuple, kwargs: dict[str, object]) -> torch.Tensor:
        """A mixer's call during the capture: end this piece, run the mixer, begin the next."""
        self._end_graph()
        result = forward(*args, **kwargs)
        i = len(self.calls)
        if i == len(self.outputs) or self.outputs[i].numel() < result.numel() or self.outputs[i].dtype != result.dtype:
            flat = torch.empty(result.numel(), dtype=result.dtype, device=result.device)
            if i == len(self.outputs):
                self.outputs.append(flat)
            else:
                self.outputs[i] = flat
        output = self.outputs[i][: result.numel()].view(result.shape)
        output.copy_(result)
        self.calls.append(MixerCall(forward, args, kwargs, output))
        self._begin_graph()
        return output

    def finish(self, hidden: torch.Tensor) -> PiecewiseGraph:
        self._end_graph()
        return PiecewiseGraph(self.pieces, self.calls, hidden)

    def restore(self) -> None:
        """Give the mixers their own forward back and end a capture left open by a failure."""
        for mixer in self.mixers:
            mixer.__dict__.pop("forward", None)
        if self.graph is not None:
            graph, self.graph = self.graph, None
            try:
                graph.capture_end()
            except RuntimeError as exc:  # the capture is invalid anyway; the stream leaves capture mode
                log.debug("ending a failed piece capture: %s", exc)


class MixedStep:
    """Owns the token-bucket input buffers (ids, positions) and, on CUDA, each bucket's
    ``PiecewiseGraph``.

    Invariants: the buffers' addresses never change (the graphs read them); a step's real tokens
    occupy rows ``[0, count)`` in chunk order and the pad chunk rows ``[count, bucket)``; the pad
    chunk writes only null blocks; a captured bucket's mixers are exactly ``mixers``, in the order
    the forward calls them.
    """

    def __init__(
        self,
        max_tokens: int,
        num_groups: int,
        block_size: int,
        device: torch.device,
        forward: Callable[[ForwardBatch], torch.Tensor],
        mixers: Sequence[nn.Module],
        index: IndexBuilder,
    ):
        """``forward``: the model (ForwardBatch -> hidden states; called under inference mode);
        ``mixers``: the modules the capture splits at (attention and recurrent mixers);
        ``index``: builds a step's ForwardBatch over given chunks, ids and positions."""
        self.buckets = token_buckets(max_tokens, doubling=device.type == "cuda")
        self.max_bucket = self.buckets[-1]
        self.num_groups = num_groups
        self.block_size = block_size
        self.device = device
        self.forward = forward
        self.mixers = list(mixers)
        self.index = index
        rows = self.max_bucket
        cuda = device.type == "cuda"
        self._host = torch.zeros(2 * rows, dtype=torch.long, pin_memory=cuda)
        self._staging = self._host.numpy()
        # the buffer the forward reads; on the CPU the staging buffer itself (no copy to make)
        self._device = self._host if not cuda else torch.zeros(2 * rows, dtype=torch.long, device=device)
        self._uploaded: torch.cuda.Event | None = None  # the last upload (CUDA): done before a rewrite
        self._graphs: dict[int, PiecewiseGraph] = {}
        self._outputs: list[torch.Tensor] = []  # each mixer's output buffer, shared by the buckets
        #: pad a step to its bucket even where no graph replays it (tests: the padding on the CPU)
        self.pad_uncaptured = False
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    # -- which steps ---------------------------------------------------------------------------------
    def accepts(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens fits a bucket."""
        return 0 < num_tokens <= self.max_bucket

    def bucket(self, count: int) -> int:
        """The smallest bucket holding ``count`` tokens."""
        for size in self.buckets:
            if size >= count:
                return size
        raise ValueError(f"step of {count} tokens exceeds the largest bucket, {self.max_bucket}")

    def pad_chunk(self, num_tokens: int) -> PadChunk:
        """``num_tokens`` pad tokens: token 0 at positions ``0 ..``, only null blocks."""
        width = -(-num_tokens // self.block_size)
        return PadChunk([0] * num_tokens, 0, [[NULL_BLOCK] * width for _ in range(self.num_groups)])

    # -- one step ------------------------------------------------------------------------------------
    def run(
        self, chunks: Sequence[StepChunk], previous_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """The hidden states of ``chunks``' tokens (rows in chunk order; ``accepts`` must hold
        for their total) and the step's ForwardBatch: padded to its bucket where that bucket's
        graph replays it (or ``pad_uncaptured``; its chunks past ``len(chunks)``, the pad chunk,
        sample nothing), else over the chunks alone. ``previous_ids``: the sampled ids (on the
        device) of the launched step before, which the chunks' placeholder tokens
        (``placeholder_id``) name; they are read there after the upload (``resolve_placeholders``)."""
        count = sum(chunk.num_tokens for chunk in chunks)
        size = self.bucket(count)
        graph = self._graphs.get(size)
        if graph is None and not self.pad_uncaptured:
            size = count
        padded: list[StepChunk] = list(chunks)
        if size > count:
            padded.append(self.pad_chunk(size - count))
        ids, positions = self._upload(padded, size)
        if previous_ids is not None:
            resolve_placeholders(ids[:count], previous_ids)
        batch = self.index(padded, ids, positions)
        hidden = graph.replay(batch) if graph is not None else self.forward(batch)
        return hidden[:count], batch

    def _upload(self, chunks: Sequence[StepChunk], size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the step's ids and positions and copy them to the device buffers; their views."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the pinned buffer's previous upload has left it
        rows = self.max_bucket
        staging = self._staging
        row = 0
        for chunk in chunks:
            n = chunk.num_tokens
            staging[row : row + n] = chunk.tokens
            staging[rows + row : rows + row + n] = np.arange(chunk.start, chunk.start + n)
            row += n
        device = self._device
        if device is not self._host:
            device[:size].copy_(self._host[:size], non_blocking=True)
            device[rows : rows + size].copy_(self._host[rows : rows + size], non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return device[:size], device[rows : rows + size]

    # -- CUDA graphs ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's forward as pieces (largest first, one memory pool) from an
        all-pad step: only null blocks are written. Records ``capture_seconds`` and
        ``capture_bytes``."""
        if self.device.type != "cuda":
            raise RuntimeError("MixedStep.capture needs a CUDA device")
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        started, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.buckets):
            pad: list[StepChunk] = [self.pad_chunk(size)]
            ids, positions = self._upload(pad, size)
            batch = self.index(pad, ids, positions)
            for _ in range(2):  # compile kernels and create library handles outside the capture
                self.forward(batch)
            torch.cuda.synchronize(self.device)
            pieces = PieceCapture(self.mixers, pool, self._outputs)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(stream):
                    pieces.begin()
                    hidden = self.forward(batch)
                    graph = pieces.finish(hidden)
            finally:
                pieces.restore()
                torch.cuda.current_stream(self.device).wait_stream(stream)
            if len(graph.calls) != len(self.mixers):
                raise RuntimeError(f"captured {len(graph.calls)} mixer calls, the model has {len(self.mixers)} mixers")
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info(
            "captured %d mixed-step buckets (%d..%d tokens, %d pieces each) in %.2f s, %.1f MiB",
            len(self._graphs),
            self.buckets[0],
            self.max_bucket,
            len(self.mixers) + 1,
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    def drop_graphs(self) -> None:
        """Forget every captured bucket (after a failed capture, or at close): steps then run the
        forward uncaptured from the same buffers."""
        self._outputs.clear()
        if not self._graphs:
            return
        self._graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)
