"""``POST /v1/chat/completions``: one engine request with ``n`` choices, streamed or whole."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vivace.engine.outputs import CompletionOutput, TokenLogprob
from vivace.engine.sampling_params import StructuredOutput
from vivace.server.errors import APIError
from vivace.server.generation import EngineRequest, run_whole, timings_of, usage_of
from vivace.server.prompts import chat_prompt_ids, fit_max_tokens, off_the_loop, parse_body, sampling_params
from vivace.server.request_id import request_id_of
from vivace.server.protocol import ChatCompletionRequest
from vivace.server.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatLogprobs, ChatTokenLogprob, DeltaMessage, FunctionCall, FunctionCallDelta, ToolCall,
    ToolCallDelta, TopLogprob, prompt_logprobs_of)
from vivace.server.sse import sse_event, sse_response
from vivace.server.structured import check_compiles, json_schema, requested_constraint, structured_output
from vivace.server.tool_parser import ToolCallParser, parse_tool_calls
from vivace.server.tools import call_grammar, parameters_schema, tool_choice
from vivace.server.state import server_state

if TYPE_CHECKING:
    from vivace.engine.async_engine import AsyncEngine
    from vivace.server.admission import Ticket


async def create_chat_completion(request: Request) -> Response:
    """OpenAI chat completions; see ``vivace.server.protocol.ChatCompletionRequest``."""
    state = server_state(request)
    body = await parse_body(request, ChatCompletionRequest, state.metrics.work["parse"])
    job, ticket, calls = await start_chat(request, body, "chatcmpl")
    if body.stream:
        return sse_response(_chunks(job, state.model_name(body.model), body.include_usage(), body.continuous_usage(),
                                    calls), ticket.release, state.metrics.work["sse_write"])
    if not await run_whole(request, job, ticket.release):
        return Response(status_code=499)
    return JSONResponse(_response(job, state.model_name(body.model), calls, body.prompt_logprobs)
                        .model_dump(mode="json"))


async def start_chat(request: Request, body: ChatCompletionRequest, id_prefix: str
                     ) -> tuple[EngineRequest, Ticket, bool]:
    """The engine request for ``body`` (templated, its limits and grammar checked) and its
    admission ticket, which the caller releases when the answer ends; and whether tool calls
    may be in its output. Raises APIError (400, 404, 429, 503) before anything runs."""
    state = server_state(request)
    caller = state.caller(request)
    engine = state.engine_for(body.model, caller)
    choice = tool_choice(body)
    prompt_ids = await off_the_loop(state.metrics.work["prompt"], chat_prompt_ids, engine.tokenizer, body, choice,
                                    size=sum(len(m.text()) for m in body.messages))
    max_tokens = fit_max_tokens(len(prompt_ids), body.requested_max_tokens(),
                                engine.max_model_len, "messages")
    params = sampling_params(body, max_tokens, body.requested_logprobs(), body.prompt_logprobs)
    params.structured = await _constraint(engine, body, choice)
    job = EngineRequest(engine, state.metrics, prompt_ids, params, request_id_of(request, id_prefix),
                        caller.priority(body.priority), caller.deadlines)
    ticket = state.admission.admit(caller.api_key, caller.tier, [job])
    return job, ticket, choice != "none"


async def _constraint(engine: AsyncEngine, body: ChatCompletionRequest, choice: str
                      ) -> StructuredOutput | None:
    """The output's grammar: the tool-call grammar when tools may be called, else what
    ``response_format`` or vLLM's extras ask for. Each part is checked to compile (400)."""
    if choice == "none" or not body.tools:
        return await requested_constraint(engine, body)
    if structured_output(body) is not None:
        raise APIError(400, "A structured-output constraint can't be combined with tool calls; "
                            "set tool_choice to \"none\" or drop it", param="tool_choice")
    for i, tool in enumerate(body.tools):
        param = f"tools.{i}.function.parameters"
        await check_compiles(engine, param, json_schema(parameters_schema(tool), param))
    grammar = call_grammar(body.tools, choice, body.parallel_tool_calls)
    await check_compiles(engine, "tools", grammar)
    return grammar


def _logprobs(job: EngineRequest, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
    if job.params.logprobs is None:
        return None
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
            top_logprobs=[TopLogprob(token=text, logprob=value, bytes=list(text.encode()))
                          for _, text, value in lp.top])
        for lp in logprobs or []])


def _message(text: str, finish_reason: str | None, calls: bool) -> tuple[AssistantMessage, str | None]:
    """The assistant's message, tool calls read out of its text when they may be there."""
    if not calls:
        return AssistantMessage(content=text), finish_reason
    content, parsed = parse_tool_calls(text)
    tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                  for c in parsed]
    return AssistantMessage(content=content, tool_calls=tool_calls), _finish(finish_reason, bool(parsed))


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _response(job: EngineRequest, model: str, calls: bool, prompt_logprobs: int | None) -> ChatCompletionResponse:
    """The whole answer; with ``prompt_logprobs`` asked for, the rendered prompt's logprobs (vLLM's,
    beside the choices: every choice has the same prompt)."""
    choices = []
    for c in job.choices:
        message, reason = _message(c.text, c.finish_reason, calls)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=_logprobs(job, c.logprobs),
                                  finish_reason=reason))
    scored = job.choices[0].prompt_logprobs
    return ChatCompletionResponse(id=job.request_id, model=model, choices=choices,
                                  usage=usage_of([job]), timings=timings_of(job),
                                  prompt_logprobs=None if prompt_logprobs is None or scored is None
                                  else prompt_logprobs_of(scored, prompt_logprobs))


def _chunk_choice(job: EngineRequest, delta: CompletionOutput,
                  parser: ToolCallParser | None) -> ChatChunkChoice | None:
    reason = delta.finish_reason.value if delta.finish_reason else None
    text, tool_deltas = delta.text, []
    if parser is not None:
        text, tool_deltas = parser.feed(delta.text)
        if reason is not None:
            text += parser.finish()[0]
            reason = _finish(reason, any(call.name is not None for call in parser.calls))
    # One event per token, even one that adds no text yet (part of a character, a possible stop
    # string's start, an id the tokenizer lacks), as vLLM does: the stream keeps the step's cadence.
    # Text a tool-call parser holds back sends nothing, so a call's message never gets content "".
    silent = not (text or tool_deltas) if parser is not None else not delta.token_ids
    if silent and reason is None and not delta.logprobs:
        return None
    message = DeltaMessage(content=text if text or not tool_deltas else None, tool_calls=[
        ToolCallDelta(index=d.index, id=d.id, type="function" if d.id else None,
                      function=FunctionCallDelta(name=d.name, arguments=d.arguments))
        for d in tool_deltas])
    return ChatChunkChoice(index=delta.index, delta=message, logprobs=_logprobs(job, delta.logprobs),
                           finish_reason=reason)


async def _chunks(job: EngineRequest, model: str, include_usage: bool, continuous_usage: bool,
                  calls: bool) -> AsyncGenerator[str, None]:
    """The stream's chunks; with ``continuous_usage`` each carries the usage so far."""
    def chunk(choices: list[ChatChunkChoice], **extra: object) -> str:
        if continuous_usage:
            extra.setdefault("usage", usage_of([job]))
        return sse_event(ChatCompletionChunk(id=job.request_id, model=model, choices=choices,
                                             **extra))

    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(job.params.n)])
    parsers = {i: ToolCallParser() for i in range(job.params.n)} if calls else {}
    async with contextlib.aclosing(job.deltas()) as deltas:
        async for out in deltas:
            choices = [c for c in (_chunk_choice(job, d, parsers.get(d.index)) for d in out.outputs)
                       if c is not None]
            if choices or out.finished:
                yield chunk(choices, timings=timings_of(job) if out.finished else None)
    if include_usage:
        yield chunk([], usage=usage_of([job]))
