"""``POST /v1/chat/completions``: one engine request with ``n`` choices, streamed or whole."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vivace.engine.outputs import CompletionOutput, TokenLogprob
from vivace.server.generation import (
    ClientDisconnected, EngineRequest, timings_of, unless_disconnected, usage_of)
from vivace.server.prompts import chat_prompt_ids, fit_max_tokens, parse_body, sampling_params
from vivace.server.protocol import ChatCompletionRequest
from vivace.server.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatLogprobs, ChatTokenLogprob, DeltaMessage, TopLogprob)
from vivace.server.sse import sse_event, sse_response
from vivace.server.state import server_state


async def create_chat_completion(request: Request) -> Response:
    """OpenAI chat completions; see ``vivace.server.protocol.ChatCompletionRequest``."""
    state = server_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    engine = state.engine_for(body.model)
    prompt_ids = chat_prompt_ids(engine.tokenizer, body)
    max_tokens = fit_max_tokens(len(prompt_ids), body.requested_max_tokens(),
                                engine.max_model_len, "messages")
    params = sampling_params(body, max_tokens, body.requested_logprobs())
    caller = state.caller(request)
    job = EngineRequest(engine, state.metrics, prompt_ids, params, f"chatcmpl-{uuid.uuid4().hex}",
                        caller.priority(body.priority), caller.deadlines)
    ticket = state.admission.admit(caller.api_key, caller.tier, [job])
    if body.stream:
        return sse_response(_chunks(job, state.model_name(), body.include_usage()), ticket.release)
    try:
        await unless_disconnected(request, job.run())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        ticket.release()
    return JSONResponse(_response(job, state.model_name()).model_dump(mode="json"))


def _logprobs(job: EngineRequest, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
    if job.params.logprobs is None:
        return None
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
            top_logprobs=[TopLogprob(token=text, logprob=value, bytes=list(text.encode()))
                          for _, text, value in lp.top])
        for lp in logprobs or []])


def _response(job: EngineRequest, model: str) -> ChatCompletionResponse:
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=_logprobs(job, c.logprobs), finish_reason=c.finish_reason)
               for c in job.choices]
    return ChatCompletionResponse(id=job.request_id, model=model, choices=choices,
                                  usage=usage_of([job]), timings=timings_of(job))


def _chunk_choice(job: EngineRequest, delta: CompletionOutput) -> ChatChunkChoice | None:
    reason = delta.finish_reason.value if delta.finish_reason else None
    if not delta.text and reason is None and not delta.logprobs:
        return None
    return ChatChunkChoice(index=delta.index, delta=DeltaMessage(content=delta.text),
                           logprobs=_logprobs(job, delta.logprobs), finish_reason=reason)


async def _chunks(job: EngineRequest, model: str, include_usage: bool) -> AsyncGenerator[str, None]:
    def chunk(choices: list[ChatChunkChoice], **extra: object) -> str:
        return sse_event(ChatCompletionChunk(id=job.request_id, model=model, choices=choices,
                                             **extra))

    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(job.params.n)])
    async with contextlib.aclosing(job.deltas()) as deltas:
        async for out in deltas:
            choices = [c for c in (_chunk_choice(job, d) for d in out.outputs) if c is not None]
            if choices or out.finished:
                yield chunk(choices, timings=timings_of(job) if out.finished else None)
    if include_usage:
        yield chunk([], usage=usage_of([job]))
