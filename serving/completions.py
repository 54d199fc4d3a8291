"""The generation endpoints: ``/v1/completions`` and ``/v1/chat/completions`` over ``Cluster``.

The ingress is the entry point of an HTTP request: it checks the body and every prompt once
(token ids against the vocabulary, room in the context) and hands each prompt inward as a
``ValidatedPrompt`` with its token ids, the user's text (so nothing decodes it back) and its cache
salt. One HTTP request becomes one cluster request per prompt (``Cluster.agenerate``, the same
path as the driver API); the deltas of all its prompts meet in one queue, the only one between
the workers' streams and the client, and are merged into OpenAI's response or server-sent-event
chunks; ``usage`` counts the prompt's tokens, the generated tokens and the prompt tokens the
workers served from their prefix cache. Leaving early (a client that disconnects, a cancelled
handler) cancels every prompt's task, which aborts it on its workers and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from cluster.api import Cluster, ClusterCompletion, Delta
from engine.sampling_params import SamplingParams
from engine.validation import ValidatedPrompt, in_vocabulary, leaves_room
from serving.errors import APIError, bad_request, error_body, leading_field, model_not_found
from serving.metrics import ServeMetrics
from serving.protocol import DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from serving.tools import ToolCalling, ToolCallStream, ToolFieldError, finish_reason_of

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A validated request turned into checked prompts and sampling parameters, ready to run."""

    kind: str  # "text_completion" or "chat.completion"
    prompts: list[ValidatedPrompt]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    tool_calling: ToolCalling | None = None  # a chat with tools: its output is parsed for calls


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

    # -- preparing ----------------------------------------------------------------------------------
    def prepare_completion(self, body: CompletionRequest) -> Prepared:
        self._check_model(body.model)
        ids = [self._prompt_ids(p, "prompt") for p in body.prompts]
        max_tokens = self._max_tokens(ids, body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
        prompts = [ValidatedPrompt(tuple(i), p if isinstance(p, str) else None, body.cache_salt)
                   for p, i in zip(body.prompts, ids, strict=True)]  # fmt: skip
        return Prepared("text_completion", prompts, self._sampling(body, max_tokens), body.stream,
                        body.include_usage, f"cmpl-{uuid.uuid4().hex}")  # fmt: skip

    def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        self._check_model(body.model)
        messages = [m.for_template() for m in body.messages]
        tools = body.tool_calling
        try:
            ids = self.cluster.model.tokenizer.chat_token_ids(messages, body.add_generation_prompt,
                                                              tools.template_tools() if tools else None)  # fmt: skip
        except ValueError as exc:
            raise bad_request("messages", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the template refused the conversation (jinja's TemplateError)
            raise bad_request("messages", f"messages: the chat template refused them ({exc})") from None
        self._check_ids([ids], "messages")
        max_tokens = self._max_tokens([ids], body.requested_max_tokens, None)
        prompt = ValidatedPrompt(tuple(ids), None, body.cache_salt)  # the template's text is not the user's
        sampling = self._sampling(body, max_tokens)
        try:
            sampling = tools.constrain(sampling) if tools else sampling
        except ToolFieldError as exc:
            raise bad_request(exc.param, str(exc)) from None
        return Prepared("chat.completion", [prompt], sampling, body.stream, body.include_usage,
                        f"chatcmpl-{uuid.uuid4().hex}", tool_calling=tools)  # fmt: skip

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
            raise bad_request("prompt" if default is not None else "messages",
                              f"prompt: {longest} tokens; the model's context is {limit} tokens, leaving no room "
                              f"to generate", code="context_length_exceeded")  # fmt: skip
        max_tokens = requested if requested is not None else (default or limit - longest)
        if longest + max_tokens > limit:
            raise bad_request("max_tokens", f"max_tokens: {max_tokens} + the prompt's {longest} tokens exceed the "
                              f"model's context of {limit} tokens (got {max_tokens})",
                              code="context_length_exceeded")  # fmt: skip
        return max_tokens

    @staticmethod
    def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        try:
            return body.sampling(max_tokens)
        except ValueError as exc:  # the engine's own checks, e.g. "top_p: must be in (0, 1]"
            raise bad_request(leading_field(str(exc)), str(exc)) from None

    # -- running ------------------------------------------------------------------------------------
    async def respond(self, prepared: Prepared) -> dict[str, Any] | AsyncIterator[str]:
        """The JSON body, or an async iterator of SSE lines when streaming; 429 (raised here,
        before any byte is sent) when the queue bound is full."""
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
        count = len(prepared.prompts)
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
        """Every prompt's deltas and completion as ``(index, item)``, in arrival order: each
        prompt's request hands its deltas straight into one queue (``Cluster.agenerate``'s
        ``on_delta``). Leaving early cancels the requests, which aborts them on their workers."""
        queue: asyncio.Queue[tuple[int, Delta | ClusterCompletion | BaseException | None]] = asyncio.Queue()

        async def one(index: int, prompt: ValidatedPrompt) -> None:
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
                completion = await self.cluster.agenerate(prompt, prepared.sampling, request_id=request_id,
                                                          on_delta=on_delta)  # fmt: skip
                # arrival to the last token: the cluster's TTFT (from arrival) plus the stream after it
                tokens_s = last - first if first is not None and last is not None else None
                self.metrics.e2e_latency.observe(completion.ttft_s + tokens_s if tokens_s is not None
                                                 else completion.latency_s)  # fmt: skip
                queue.put_nowait((index, completion))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.ensure_future(one(i, prompt)) for i, prompt in enumerate(prepared.prompts)]
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
                    completions[index] = item
                    self._record(item)
        except (RuntimeError, ValueError) as exc:
            raise APIError(500, f"generation failed: {exc}", code="generation_failed") from None
        ordered = [completions[i] for i in range(len(prepared.prompts))]
        return {
            "id": prepared.request_id,
            "object": prepared.kind,
            "created": prepared.created,
            "model": self.model_name,
            "choices": [self._choice(prepared, i, c) for i, c in enumerate(ordered)],
            "usage": usage(prepared, ordered),
        }

    async def _sse(self, prepared: Prepared) -> AsyncIterator[str]:
        """Server-sent events; the first step only admits (and yields an empty string)."""
        count = self._admit(prepared)
        finished: list[ClusterCompletion] = []
        parsers: dict[int, ToolCallStream] = {}  # per choice, with tools
        try:
            yield ""
            if prepared.kind == "chat.completion":
                yield _event(self._chunk(prepared, 0, {"role": "assistant", "content": ""}, None))
            async with aclosing(self._run(prepared)) as items:
                async for index, item in items:
                    if isinstance(item, Delta) and prepared.tool_calling is not None:
                        parser = parsers.setdefault(index, prepared.tool_calling.stream())
                        for delta in parser.feed(item.text):
                            yield _event(self._chunk(prepared, index, delta, None))
                        continue
                    if isinstance(item, Delta):
                        if item.text:
                            yield _event(self._chunk(prepared, index, self._delta(prepared, item.text), None))
                        continue
                    finished.append(item)
                    self._record(item)
                    reason = _finish_reason(item)
                    if prepared.tool_calling is not None:
                        parser = parsers.setdefault(index, prepared.tool_calling.stream())
                        for delta in parser.finish():
                            yield _event(self._chunk(prepared, index, delta, None))
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
        self.metrics.record_completion(len(completion.prompt_token_ids), len(completion.token_ids),
                                       completion.cached_tokens, completion.ttft_s)  # fmt: skip

    # -- formatting ---------------------------------------------------------------------------------
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
        choice: dict[str, Any] = {"index": index, ("delta" if chat else "text"): delta, "logprobs": None,
                                  "finish_reason": reason}  # fmt: skip
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


def usage(prepared: Prepared, completions: list[ClusterCompletion]) -> dict[str, Any]:
    """OpenAI's usage block; ``cached_tokens`` are the prompt tokens served from the prefix cache."""
    prompt = sum(len(c.prompt_token_ids) for c in completions)
    generated = sum(len(c.token_ids) for c in completions)
    cached = sum(c.cached_tokens for c in completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _finish_reason(completion: ClusterCompletion) -> str:
    return "length" if completion.finish_reason == "length" else "stop"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
