"""``POST /v1/responses``: OpenAI's Responses API, stateless, answered on chat completions'
path (``vivace.server.chat.start_chat``): the same template, sampling, tools, structured
output, limits, admission, metrics and abort on disconnect. Errors name the Responses API's
fields (``input``, ``max_output_tokens``, ``tools.0.parameters``), not chat's."""

from __future__ import annotations

import re
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vivace.server.chat import StartedChat, chat_logprobs, start_chat
from vivace.engine.outputs import TokenLogprob
from vivace.server.errors import APIError, renamed
from vivace.server.generation import EngineRequest, run_whole, submitted, usage_with_thinking
from vivace.server.prompts import parse_body
from vivace.server.responses import ChatTokenLogprob
from vivace.server.responses_objects import (
    FunctionToolCall, OutputMessage, OutputText, ReasoningItem, ReasoningText, ResponseObject)
from vivace.server.responses_protocol import NamedFunction, ResponsesRequest
from vivace.server.responses_stream import complete, item_id, response_events
from vivace.server.sse import sse_response
from vivace.server.state import server_state

# Chat's names (and pydantic's union tags) for the Responses API's fields.
_RENAMES = [
    (re.compile(r"^input\.(\d+)\.(?:message|function_call|function_call_output|reasoning)(?=\.|$)"), r"input.\1"),
    (re.compile(r"^messages(\..*)?$"), "input"),
    (re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^response_format\.json_schema\."), "text.format."),
    (re.compile(r"^response_format$"), "text.format"),
    (re.compile(r"^max_(?:completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
]


async def create_response(request: Request) -> Response:
    """OpenAI's Responses API; see ``vivace.server.responses_protocol.ResponsesRequest``."""
    state = server_state(request)
    try:
        body = await parse_body(request, ResponsesRequest, state.metrics.work["parse"])
        if body.output_logprobs() and state.settings.reasoning_parser:
            raise APIError(400, "message.output_text.logprobs are not served with a reasoning parser (they "
                                "would mix the thinking's tokens with the answer's): leave it out of include",
                           param="include")
        chat = await start_chat(request, body.chat_request(), "resp_")
    except APIError as exc:
        raise _in_responses_terms(exc) from None
    answer = _settings(body, chat.job, state.model_name(body.model))
    if body.stream:
        on_close = submitted([chat.job], chat.ticket.release)
        return sse_response(response_events(chat.job, answer, chat.calls, chat.thinking, chat.tool_format,
                                            partial(_text_logprobs, chat.job)),
                            on_close,
                            state.metrics.work["sse_write"], end="")
    if not await run_whole(request, chat.job, chat.ticket.release):
        return Response(status_code=499)
    thought = _output(answer, chat)
    complete(answer, chat.job, usage_with_thinking(chat.job, chat.thinking, [thought]))
    return JSONResponse(answer.model_dump(mode="json"))


def _in_responses_terms(exc: APIError) -> APIError:
    exc.message = exc.message.replace("lower max_tokens", "lower max_output_tokens")
    return renamed(exc, _RENAMES)


def _settings(body: ResponsesRequest, job: EngineRequest, model: str) -> ResponseObject:
    """The answer before any output: the request's settings, echoed as OpenAI does (the sampling
    values the job runs with, the server's defaults for those the request left out)."""
    choice = body.tool_choice
    form = body.text.format if body.text is not None else None
    return ResponseObject(
        id=job.request_id, model=model, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
        temperature=job.params.temperature, top_p=job.params.top_p, parallel_tool_calls=body.parallel_tool_calls,
        tool_choice=choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto",
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
        text={"format": form.model_dump(by_alias=True, exclude_none=True) if form else {"type": "text"},
              **({"verbosity": body.text.verbosity} if body.text is not None and body.text.verbosity else {})},
        reasoning=body.reasoning.model_dump() if body.reasoning is not None else None,
        metadata=body.metadata or {}, store=False, user=body.user, top_logprobs=body.top_logprobs)


def _text_logprobs(job: EngineRequest, logprobs: list[TokenLogprob] | None) -> list[ChatTokenLogprob]:
    """The output_text logprobs of ``logprobs`` (none unless the request included them)."""
    found = chat_logprobs(job, logprobs)
    return found.content if found is not None else []


def _output(answer: ResponseObject, chat: StartedChat) -> bool:
    """The finished request's output items: its thinking (with a reasoning parser), its answer as a
    message, then its function calls (the last item is incomplete when the output was cut off).
    Returns whether the output had a think block."""
    job = chat.job
    split, parsed = chat.whole_answer()
    if split.reasoning is not None:
        answer.output.append(ReasoningItem(id=item_id("rs"), content=[ReasoningText(text=split.reasoning)]))
    content = split.content
    if content is not None or not (parsed or answer.output):
        answer.output.append(OutputMessage(id=item_id("msg"), content=[OutputText(
            text=content or "", logprobs=_text_logprobs(job, job.choices[0].logprobs))]))
    answer.output += [FunctionToolCall(id=item_id("fc"), call_id=call.id, name=call.name or "",
                                       arguments=call.arguments) for call in parsed]
    for item in answer.output:
        item.status = "completed"
    if job.choices[0].finish_reason == "length":
        answer.output[-1].status = "incomplete"
    return split.thought
