"""The generation endpoints: ``/v1/completions`` and ``/v1/chat/completions`` over ``Cluster``.

The ingress is the entry point of an HTTP request: it checks the body and every prompt once
(token ids against the vocabulary, room in the context) and hands each prompt inward as a
``ValidatedPrompt`` with its token ids, the user's text (so nothing decodes it back) and its cache
salt. One HTTP request becomes one cluster request per prompt and sample (``Cluster.agenerate``,
the same path as the driver API): ``n`` samples per prompt, or ``best_of`` of which the ``n``
with the highest cumulative logprob are returned; sample ``j`` of a seeded request uses
``seed + j``. Choice ``prompt_index * n + j`` is the ``j``-th choice of a prompt, as OpenAI and vLLM
number them. The deltas of all its requests meet in one queue, the only one between the workers'
streams and the client, and are merged into OpenAI's response or server-sent-event chunks, with
logprobs in OpenAI's shapes (``serving.logprob_format``) and, for ``echo``, the prompt first;
``usage`` counts each prompt's tokens once, every sample's generated tokens, and the prompt tokens
the workers served from their prefix cache. Leaving early (a client that disconnects, a cancelled
handler) cancels every request's task, which aborts it on its workers and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.api import Cluster, ClusterCompletion, Delta
from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.structured_spec import validate_structured
from engine.validation import InvalidRequestError, ValidatedPrompt, in_vocabulary, leaves_room
from serving.errors import APIError, bad_request, error_body, leading_field, model_not_found
from serving.logprob_format import (
    CompletionLogprobs,
    TokenStrings,
    chat_logprobs,
    cumulative_logprob,
    join_completion_pieces,
)
from serving.metrics import ServeMetrics
from serving.protocol import DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from serving.tools import ToolCalling, ToolCallStream, ToolFieldError, finish_reason_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplePlan:
    """The samples each prompt of a request runs and what the client sees of them.

    Invariants: ``len(samples) >= n``; more samples than ``n`` (``best_of``) all report logprobs,
    by which the ``n`` best are chosen; ``prompt_logprobs`` and ``score_only`` only with ``echo``."""

    samples: tuple[SamplingParams, ...]  # sample j's parameters (its seed is seed + j)
    n: int  # choices per prompt
    echo: bool = False  # the prompt's text (and its logprobs, with logprobs) precedes each choice
    logprobs: int | None = None  # top logprobs shown per output token; None: no logprobs shown
    prompt_logprobs: bool = False  # the echoed prompt's logprobs are shown
    # max_tokens 0 with echo: each sample runs one token, which no response shows or counts
    score_only: bool = False


@dataclass
class Prepared:
    """A validated request turned into checked prompts and sampling parameters, ready to run:
    request ``p * len(plan.samples) + j`` is sample ``j`` of prompt ``p``."""

    kind: str  # "text_completion" or "chat.completion"
    prompts: list[ValidatedPrompt]
    plan: SamplePlan
    stream: bool
    include_usage: bool
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    tool_calling: ToolCalling | None = None  # a chat with tools: its output is parsed for calls

    @property
    def num_requests(self) -> int:
        return len(self.prompts) * len(self.plan.samples)


class Admission:
    """The queue bound of one ingress replica: at most ``limit`` prompts in flight."""

    def __init__(self, limit: int, retry_after_s: int):
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    def admit(self, count: int) -> None:
        if self.in_flight + count > self.limit:
            raise APIError(
                429,
                f"the server is at its queue bound ({self.in_flight} of {self.limit} requests in flight); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_flight += count

    def release(self, count: int) -> None:
        self.in_flight -= count


class Generation:
    """Owns the path from a validated body to its response: tokenizing, the context-length
    check, admission, running every prompt on the cluster and formatting the result."""

    def __init__(self, cluster: Cluster, model_name: str, metrics: ServeMetrics, admission: Admission):
        self.cluster = cluster
        self.model_name = model_name
        self.metrics = metrics
        self.admission = admission
        self._strings: TokenStrings | None = None  # built on first use: the model is known once serving

    # -- preparing ----------------------------------------------------------------------------------
    def prepare_completion(self, body: CompletionRequest) -> Prepared:
        self._check_model(body.model)
        ids = [self._prompt_ids(p, "prompt") for p in body.prompts]
        # scoring a prompt runs one token (the engine always samples one), which is then dropped
        requested = 1 if body.score_only else body.max_tokens
        max_tokens = self._max_tokens(ids, requested, DEFAULT_COMPLETION_MAX_TOKENS)
        prompts = [
            ValidatedPrompt(tuple(i), p if isinstance(p, str) else None, body.cache_salt)
            for p, i in zip(body.prompts, ids, strict=True)
        ]
        plan = self._sampling(body, max_tokens)
        return Prepared(
            "text_completion",
            prompts,
            replace(plan, score_only=body.score_only),
            body.stream,
            body.include_usage,
            f"cmpl-{uuid.uuid4().hex}",
        )

    def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        self._check_model(body.model)
        messages = [m.for_template() for m in body.messages]
        tools = body.tool_calling
        try:
            ids = self.cluster.model.tokenizer.chat_token_ids(
                messages, body.add_generation_prompt, tools.template_tools() if tools else None
            )
        except ValueError as exc:
            raise bad_request("messages", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the template refused the conversation (jinja's TemplateError)
            raise bad_request("messages", f"messages: the chat template refused them ({exc})") from None
        self._check_ids([ids], "messages")
        max_tokens = self._max_tokens([ids], body.requested_max_tokens, None)
        prompt = ValidatedPrompt(tuple(ids), None, body.cache_salt)  # the template's text is not the user's
        plan = self._sampling(body, max_tokens)
        if tools is not None:
            try:
                samples = tuple(tools.constrain(sample) for sample in plan.samples)
            except ToolFieldError as exc:
                raise bad_request(exc.param, str(exc)) from None
            if samples[0].structured is not None:
                _check_structured(samples[0].structured, "tool_choice")
            plan = replace(plan, samples=samples)
        return Prepared(
            "chat.completion",
            [prompt],
            plan,
            body.stream,
            body.include_usage,
            f"chatcmpl-{uuid.uuid4().hex}",
            tool_calling=tools,
        )

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise model_not_found(model, self.model_name)

    def _prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.cluster.model.tokenizer.encode(prompt))
            if not ids:
                raise bad_request(param, f"{param}: encodes to no tokens (got {prompt!r})")
            return ids
        self._check_ids([prompt], param)
        return list(prompt)

    def _check_ids(self, prompts: list[list[int]], param: str) -> None:
        vocab = self.cluster.model.vocab_size
        for ids in prompts:
            bad = next((t for t in ids if not in_vocabulary(t, vocab)), None)
            if bad is not None:
                raise bad_request(param, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})")

    def _max_tokens(self, prompts: list[list[int]], requested: int | None, default: int | None) -> int:
        limit = self.cluster.model.max_model_len
        longest = max(len(ids) for ids in prompts)
        if not leaves_room(longest, limit):
            raise bad_request(
                "prompt" if default is not None else "messages",
                f"prompt: {longest} tokens; the model's context is {limit} tokens, leaving no room to generate",
                code="context_length_exceeded",
            )
        max_tokens = requested if requested is not None else (default or limit - longest)
        if longest + max_tokens > limit:
            raise bad_request(
                "max_tokens",
                f"max_tokens: {max_tokens} + the prompt's {longest} tokens exceed the "
                f"model's context of {limit} tokens (got {max_tokens})",
                code="context_length_exceeded",
            )
        return max_tokens

    def _sampling(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplePlan:
        try:
            base = body.sampling(max_tokens)
        except ValueError as exc:  # the engine's own checks, e.g. "top_p: must be in (0, 1]"
            raise bad_request(leading_field(str(exc)), str(exc)) from None
        vocab = self.cluster.model.vocab_size
        bad = next((t for t, _ in base.logit_bias if not in_vocabulary(t, vocab)), None)
        if bad is not None:
            raise bad_request("logit_bias", f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
        if base.structured is not None:
            _check_structured(base.structured, body.structured_param)
        count = body.samples_per_prompt
        if count > body.n and base.logprobs is None:  # best_of ranks the samples by their logprobs
            base = base.replace(logprobs=0)
        seeded = base.seed
        samples = tuple(
            base if j == 0 or seeded is None else base.replace(seed=(seeded + j) % 2**63) for j in range(count)
        )
        echo = isinstance(body, CompletionRequest) and body.echo
        return SamplePlan(samples, body.n, echo, body.output_logprobs, body.prompt_logprobs is not None)

    # -- running ------------------------------------------------------------------------------------
    async def respond(self, prepared: Prepared) -> dict[str, Any] | AsyncIterator[str]:
        """The JSON body, or an async iterator of SSE lines when streaming; 429 (raised here,
        before any byte is sent) when the queue bound is full."""
        samples = len(prepared.plan.samples)
        if samples > 1 and prepared.num_requests > self.admission.limit:
            field_name = "n" if samples == prepared.plan.n else "best_of"
            raise bad_request(
                field_name,
                f"{field_name}: {len(prepared.prompts)} prompt(s) x {samples} samples = "
                f"{prepared.num_requests} requests exceed the server's queue bound of "
                f"{self.admission.limit} (got {samples})",
            )
        if prepared.stream:
            events = self._sse(prepared)
            await anext(events)  # admission happens here; the generator now owns the release
            return events
        count = self._admit(prepared)
        try:
            return await self._whole(prepared)
        finally:
            self._release(count)

    def _admit(self, prepared: Prepared) -> int:
        count = prepared.num_requests
        try:
            self.admission.admit(count)
        except APIError:
            self.metrics.rejected.inc()
            raise
        self.metrics.in_flight.inc(count)
        return count

    def _release(self, count: int) -> None:
        self.admission.release(count)
        self.metrics.in_flight.dec(count)

    async def _run(self, prepared: Prepared) -> AsyncGenerator[tuple[int, Delta | ClusterCompletion], None]:
        """Every request's deltas and completion as ``(index, item)``, in arrival order (request
        ``index`` is sample ``index % len(samples)`` of prompt ``index // len(samples)``): each
        request hands its deltas straight into one queue (``Cluster.agenerate``'s ``on_delta``).
        Leaving early cancels the requests, which aborts them on their workers."""
        queue: asyncio.Queue[tuple[int, Delta | ClusterCompletion | BaseException | None]] = asyncio.Queue()

        async def one(index: int, prompt: ValidatedPrompt, sampling: SamplingParams) -> None:
            request_id = f"{prepared.request_id}-{index}"
            first: float | None = None
            last: float | None = None

            def on_delta(delta: Delta) -> None:
                nonlocal first, last
                if delta.num_tokens:
                    now = time.monotonic()
                    if last is not None:
                        self.metrics.record_gap(now - last, delta.num_tokens)
                    first, last = first or now, now
                queue.put_nowait((index, delta))

            try:
                # the samples of one prompt run where its first was placed: they share its cached prefix
                group = f"{prepared.request_id}-p{index // len(prepared.plan.samples)}"
                completion = await self.cluster.agenerate(
                    prompt,
                    sampling,
                    request_id=request_id,
                    on_delta=on_delta,
                    share_placement=group if len(prepared.plan.samples) > 1 else None,
                )
                # arrival to the last token: the cluster's TTFT (from arrival) plus the stream after it
                tokens_s = last - first if first is not None and last is not None else None
                self.metrics.e2e_latency.observe(
                    completion.ttft_s + tokens_s if tokens_s is not None else completion.latency_s
                )
                queue.put_nowait((index, completion))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        samples = prepared.plan.samples
        tasks = [
            asyncio.ensure_future(one(p * len(samples) + j, prompt, sampling))
            for p, prompt in enumerate(prepared.prompts)
            for j, sampling in enumerate(samples)
        ]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _whole(self, prepared: Prepared) -> dict[str, Any]:
        completions: dict[int, ClusterCompletion] = {}
        try:
            async with aclosing(self._run(prepared)) as items:
                async for index, item in items:
                    if not isinstance(item, ClusterCompletion):
                        continue
                    self._record(item)
                    completions[index] = _scored_prompt(item) if prepared.plan.score_only else item
            choices = [self._scored_choice(prepared, index, c) for index, c in self._chosen(prepared, completions)]
        except (RuntimeError, ValueError) as exc:
            raise APIError(500, f"generation failed: {exc}", code="generation_failed") from None
        return {
            "id": prepared.request_id,
            "object": prepared.kind,
            "created": prepared.created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage(prepared, completions),
        }

    @staticmethod
    def _chosen(prepared: Prepared, completions: dict[int, ClusterCompletion]) -> list[tuple[int, ClusterCompletion]]:
        """Each prompt's ``n`` choices with their indices: its samples in order, or, when it ran
        more (``best_of``), the ``n`` with the highest cumulative logprob, best first."""
        plan, per_prompt = prepared.plan, len(prepared.plan.samples)
        chosen: list[tuple[int, ClusterCompletion]] = []
        for p in range(len(prepared.prompts)):
            samples = [completions[p * per_prompt + j] for j in range(per_prompt)]
            if per_prompt > plan.n:
                samples = sorted(samples, key=lambda c: cumulative_logprob(c.logprobs), reverse=True)[: plan.n]
            chosen.extend((p * plan.n + j, c) for j, c in enumerate(samples))
        return chosen

    async def _sse(self, prepared: Prepared) -> AsyncIterator[str]:
        """Server-sent events; the first step only admits (and yields an empty string)."""
        count = self._admit(prepared)
        finished: dict[int, ClusterCompletion] = {}
        plan = prepared.plan
        # streams run exactly n samples per prompt (best_of > n is refused), so request index = choice index
        pieces = {i: self._completion_logprobs(prepared, i) for i in range(prepared.num_requests)}
        held: dict[int, list[Delta]] = {i: [] for i in range(prepared.num_requests)} if plan.prompt_logprobs else {}
        parsers: dict[int, ToolCallStream] = {}  # per choice, with tools
        try:
            yield ""
            for i in range(prepared.num_requests):
                if prepared.kind == "chat.completion":
                    yield _event(self._chunk(prepared, i, {"role": "assistant", "content": ""}, None))
                elif plan.echo and not plan.prompt_logprobs:
                    yield _event(self._chunk(prepared, i, self._prompt_text(prepared, i), None))
            async with aclosing(self._run(prepared)) as items:
                async for index, item in items:
                    if isinstance(item, Delta) and plan.score_only:
                        continue  # the one token a scored prompt runs is never shown
                    if isinstance(item, Delta) and prepared.tool_calling is not None:
                        parser = parsers.setdefault(index, prepared.tool_calling.stream())
                        for piece in parser.feed(item.text):
                            yield _event(self._chunk(prepared, index, piece, None))
                        continue
                    if isinstance(item, Delta):
                        if index in held:  # the prompt's logprobs come with the completion, and go first
                            held[index].append(item)
                        elif (chunk := self._delta_chunk(prepared, index, item, pieces[index])) is not None:
                            yield _event(chunk)
                        continue
                    self._record(item)
                    item = _scored_prompt(item) if plan.score_only else item
                    finished[index] = item
                    if index in held:
                        prompt_piece = pieces[index].prompt(item.prompt_token_ids, _required(item.prompt_logprobs))
                        pieces[index].offsets.position = len(item.prompt)
                        yield _event(self._with_logprobs(self._chunk(prepared, index, item.prompt, None), prompt_piece))
                        for delta in held.pop(index):
                            if (chunk := self._delta_chunk(prepared, index, delta, pieces[index])) is not None:
                                yield _event(chunk)
                    reason = _finish_reason(item)
                    if prepared.tool_calling is not None:
                        parser = parsers.setdefault(index, prepared.tool_calling.stream())
                        for piece in parser.finish():
                            yield _event(self._chunk(prepared, index, piece, None))
                        reason = finish_reason_of(parser, reason)
                    yield _event(self._chunk(prepared, index, self._delta(prepared, ""), reason))
            if prepared.include_usage:
                last = self._chunk(prepared, 0, {}, None)
                last["choices"] = []
                last["usage"] = usage(prepared, finished)
                yield _event(last)
        except (RuntimeError, ValueError) as exc:
            log.warning("%s: %s", prepared.request_id, exc)
            yield _event(error_body(500, f"generation failed: {exc}", code="generation_failed"))
        finally:
            self._release(count)
        yield "data: [DONE]\n\n"

    def _record(self, completion: ClusterCompletion) -> None:
        self.metrics.record_completion(
            len(completion.prompt_token_ids), len(completion.token_ids), completion.cached_tokens, completion.ttft_s
        )

    # -- formatting ---------------------------------------------------------------------------------
    @property
    def strings(self) -> TokenStrings:
        if self._strings is None:
            self._strings = TokenStrings(self.cluster.model.tokenizer)
        return self._strings

    def _scored_choice(self, prepared: Prepared, index: int, completion: ClusterCompletion) -> dict[str, Any]:
        """``_choice`` with the echoed prompt and the logprobs the request asked for."""
        choice = self._choice(prepared, index, completion)
        plan = prepared.plan
        if prepared.kind == "chat.completion":
            if plan.logprobs is not None:
                choice["logprobs"] = chat_logprobs(self.strings, _required(completion.logprobs), plan.logprobs)
            return choice
        if plan.echo:
            choice["text"] = completion.prompt + choice["text"]
        if plan.logprobs is not None:
            builder = CompletionLogprobs(self.strings)
            prompt_piece = (
                builder.prompt(completion.prompt_token_ids, _required(completion.prompt_logprobs))
                if plan.prompt_logprobs
                else None
            )
            builder.offsets.position = len(completion.prompt) if plan.echo else 0
            output_piece = builder.output(_required(completion.logprobs))
            choice["logprobs"] = join_completion_pieces(*(p for p in (prompt_piece, output_piece) if p is not None))
        return choice

    def _completion_logprobs(self, prepared: Prepared, index: int) -> CompletionLogprobs:
        """The logprobs builder of one streamed completions choice: its offsets start after an
        echoed prompt, or at 0 where the prompt's own logprobs come first."""
        plan = prepared.plan
        start = len(self._prompt_text(prepared, index)) if plan.echo and not plan.prompt_logprobs else 0
        return CompletionLogprobs(self.strings, start)

    def _prompt_text(self, prepared: Prepared, index: int) -> str:
        return self.cluster.model.prompt_text(prepared.prompts[index // len(prepared.plan.samples)])

    def _delta_chunk(
        self, prepared: Prepared, index: int, delta: Delta, piece: CompletionLogprobs
    ) -> dict[str, Any] | None:
        """The chunk of a streamed delta with its tokens' logprobs; None when it carries neither
        text nor logprobs."""
        shown = prepared.plan.logprobs
        if shown is not None and len(delta.logprobs) != delta.num_tokens:
            raise RuntimeError(f"the cluster sent {len(delta.logprobs)} logprobs for {delta.num_tokens} tokens")
        if not delta.text and (shown is None or not delta.num_tokens):
            return None
        chunk = self._chunk(prepared, index, self._delta(prepared, delta.text), None)
        if shown is None:
            return chunk
        if prepared.kind == "chat.completion":
            return self._with_logprobs(chunk, chat_logprobs(self.strings, delta.logprobs, shown))
        return self._with_logprobs(chunk, piece.output(delta.logprobs))

    @staticmethod
    def _with_logprobs(chunk: dict[str, Any], logprobs: dict[str, Any]) -> dict[str, Any]:
        chunk["choices"][0]["logprobs"] = logprobs
        return chunk

    def _choice(self, prepared: Prepared, index: int, completion: ClusterCompletion) -> dict[str, Any]:
        reason = _finish_reason(completion)
        if prepared.kind == "chat.completion" and prepared.tool_calling is not None:
            message, reason = prepared.tool_calling.message(completion.text, reason)
            return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}
        if prepared.kind == "chat.completion":
            message = {"role": "assistant", "content": completion.text}
            return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": completion.text, "logprobs": None, "finish_reason": reason}

    def _chunk(self, prepared: Prepared, index: int, delta: Any, reason: str | None) -> dict[str, Any]:
        chat = prepared.kind == "chat.completion"
        choice: dict[str, Any] = {
            "index": index,
            ("delta" if chat else "text"): delta,
            "logprobs": None,
            "finish_reason": reason,
        }
        return {
            "id": prepared.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": prepared.created,
            "model": self.model_name,
            "choices": [choice],
        }

    @staticmethod
    def _delta(prepared: Prepared, text: str) -> Any:
        if prepared.kind == "chat.completion":
            return {"content": text} if text else {}
        return text


def usage(prepared: Prepared, completions: dict[int, ClusterCompletion]) -> dict[str, Any]:
    """OpenAI's usage block over the requests that finished (by request index): each prompt's
    tokens once however many samples it ran (as vLLM counts them), every sample's generated
    tokens, and as ``cached_tokens`` the prompt tokens served from the prefix cache (for a prompt
    with several samples, the fewest any of them found cached: what the prompt itself cost)."""
    per_prompt = len(prepared.plan.samples)
    by_prompt: dict[int, list[ClusterCompletion]] = {}
    for index, completion in completions.items():
        by_prompt.setdefault(index // per_prompt, []).append(completion)
    prompt = sum(len(group[0].prompt_token_ids) for group in by_prompt.values())
    cached = sum(min(c.cached_tokens for c in group) for group in by_prompt.values())
    generated = sum(len(c.token_ids) for c in completions.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _check_structured(structured: StructuredOutput, param: str) -> None:
    """The grammar behind a structured-output field compiles; 400 naming ``param`` otherwise
    (``engine.structured_spec.validate_structured``; the client never sees a ``spec`` field)."""
    try:
        validate_structured(structured, param)
    except InvalidRequestError as exc:
        message = str(exc).replace(f"{param}.spec:", f"{param}:", 1)
        raise bad_request(param, message) from None


def _scored_prompt(completion: ClusterCompletion) -> ClusterCompletion:
    """A scored prompt's completion as the client sees it (``max_tokens: 0``): the one token it
    ran dropped, finished for its length."""
    logprobs: list[TokenLogprob] | None = [] if completion.logprobs is not None else None
    return replace(completion, text="", token_ids=[], logprobs=logprobs, finish_reason="length")


def _required(logprobs: list[Any] | None) -> list[Any]:
    """Logprobs the request asked for; RuntimeError (a 500) when the cluster sent none."""
    if logprobs is None:
        raise RuntimeError("the cluster returned no logprobs for a request that asked for them")
    return logprobs


def _finish_reason(completion: ClusterCompletion) -> str:
    return "length" if completion.finish_reason == "length" else "stop"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
