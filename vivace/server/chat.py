"""``POST /v1/chat/completions``: one engine request with ``n`` choices, streamed or whole."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vivace.engine.outputs import CompletionOutput, TokenLogprob
from vivace.engine.sampling_params import StructuredOutput
from vivace.server.errors import APIError
from vivace.server.functions import as_tools, in_function_terms, legacy_choice, legacy_chunk_choice
from vivace.server.generation import EngineRequest, run_whole, submitted, timings_of, usage_with_thinking
from vivace.server.prompts import (
    chat_prompt_ids, fit_max_tokens, off_the_loop, parse_body, sampling_params, template_size)
from vivace.server.reasoning import Split, Thinking, ThoughtSplitter, effort_template_kwargs
from vivace.server.request_id import request_id_of
from vivace.server.protocol import ChatCompletionRequest
from vivace.server.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatLogprobs, ChatTokenLogprob, DeltaMessage, FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta,
    TopLogprob, Usage, prompt_logprobs_of, thought)
from vivace.server.sse import sse_event, sse_response
from vivace.server.structured import check_compiles, checked_output, json_schema
from vivace.server.tokens import token_bytes
from vivace.server.tool_formats import ToolFormat, parameters_schema
from vivace.server.tool_parser import CallParser, ParsedCall, ToolCallParser, parse_tool_calls
from vivace.server.tools import tool_choice
from vivace.server.state import server_state

if TYPE_CHECKING:
    from vivace.engine.async_engine import AsyncEngine
    from vivace.server.admission import Ticket
    from vivace.server.state import ServerState


async def create_chat_completion(request: Request) -> Response:
    """OpenAI chat completions; see ``vivace.server.protocol.ChatCompletionRequest``."""
    state = server_state(request)
    body = await parse_body(request, ChatCompletionRequest, state.metrics.work["parse"])
    legacy = body.functions is not None
    try:
        chat = await start_chat(request, as_tools(body), "chatcmpl-")
    except APIError as exc:
        raise in_function_terms(exc) if legacy else exc from None
    if body.stream:
        on_close = submitted([chat.job], chat.ticket.release)
        return sse_response(_chunks(chat, state.model_name(body.model), body.include_usage(), body.continuous_usage(),
                                    legacy), on_close, state.metrics.work["sse_write"])
    if not await run_whole(request, chat.job, chat.ticket.release):
        return Response(status_code=499)
    answer = _response(chat, state.model_name(body.model), body.prompt_logprobs)
    if legacy:
        answer.choices = [legacy_choice(choice) for choice in answer.choices]
    return JSONResponse(answer.model_dump(mode="json"))


@dataclass(frozen=True)
class StartedChat:
    """A chat request on its way: its engine request, its admission ticket (the caller releases
    it when the answer ends), whether tool calls may be in its output and the form they are
    written in, and how a reasoning parser reads its output (None: no parser)."""

    job: EngineRequest
    ticket: Ticket
    calls: bool
    thinking: Thinking | None
    tool_format: ToolFormat

    def whole_answer(self) -> tuple[Split, list[ParsedCall]]:
        """The finished first choice read whole, as its stream hands it out: its reasoning (with a
        reasoning parser), its content (with tool calls possible: None when empty) and its calls."""
        text = self.job.choices[0].text
        split = self.thinking.split(text) if self.thinking is not None else Split(None, text, False)
        if not self.calls:
            return split, []
        content, parsed = parse_tool_calls(split.content or "", self.tool_format.parser())
        return dataclasses.replace(split, content=content), parsed


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request as the engine sees it: ``body`` with its reasoning effort's template
    variables, its tool choice ("none", "auto", "required" or a function's name), the form tool
    calls are written in, and the rendered prompt's token ids."""

    body: ChatCompletionRequest
    choice: str
    form: ToolFormat
    prompt_ids: list[int]


async def render_chat(state: ServerState, engine: AsyncEngine, body: ChatCompletionRequest) -> ChatPrompt:
    """``body``'s conversation (and tools) rendered with ``engine``'s chat template and tokenized, as
    :func:`start_chat` renders it; raises APIError (400) for what the template or tools can't take."""
    choice = tool_choice(body)
    form = state.tool_format(engine)
    effort_kwargs = effort_template_kwargs(body.reasoning_effort, state.settings.reasoning_parser)
    if effort_kwargs:  # the request's own chat_template_kwargs win
        body = body.model_copy(update={"chat_template_kwargs": {**effort_kwargs, **(body.chat_template_kwargs or {})}})
    prompt_ids = await off_the_loop(state.metrics.work["prompt"], chat_prompt_ids, engine.tokenizer, body, choice,
                                    False, form, size=template_size(body, choice))
    return ChatPrompt(body, choice, form, prompt_ids)


async def start_chat(request: Request, body: ChatCompletionRequest, id_prefix: str,
                     clamp: bool = False) -> StartedChat:
    """The engine request for ``body`` (templated, its limits and grammar checked), admitted; its
    id starts with ``id_prefix``. With a reasoning parser a grammar constrains only what follows
    the thinking. ``clamp`` cuts a max_tokens past the context to the room left
    (``vivace.server.prompts.fit_max_tokens``). Raises APIError (400, 404, 429, 503) before
    anything runs."""
    state = server_state(request)
    caller = state.caller(request)
    engine = state.engine_for(body.model, caller)
    prompt = await render_chat(state, engine, body)
    body, choice, form, prompt_ids = prompt.body, prompt.choice, prompt.form, prompt.prompt_ids
    max_tokens = fit_max_tokens(len(prompt_ids), body.requested_max_tokens(), engine.max_model_len, "messages",
                                engine.sampling_defaults.get("max_tokens"), clamp)
    params = sampling_params(body, max_tokens, body.requested_logprobs(), body.prompt_logprobs,
                             engine.sampling_defaults)
    parser = state.reasoning_parser(engine)
    thinking = parser.thinking(prompt_ids) if parser is not None else None
    params.structured = await _constraint(engine, body, choice, thinking, form)
    if choice != "none" and form.keeps_special_tokens:  # the parser reads the calls' special markers
        params.skip_special_tokens = False
    if body.prediction is not None:
        text = body.prediction.text()
        params.prediction = await off_the_loop(state.metrics.work["prompt"], partial(
            engine.tokenizer.encode, add_special_tokens=False), text, size=len(text))
    job = EngineRequest(engine, state.metrics, prompt_ids, params, request_id_of(request, id_prefix),
                        caller.priority(body.priority), caller.deadlines, model=state.model_name(body.model))
    ticket = state.admission.admit(caller.api_key, caller.tier, [job])
    return StartedChat(job, ticket, choice != "none", thinking, form)


async def _constraint(engine: AsyncEngine, body: ChatCompletionRequest, choice: str, thinking: Thinking | None,
                      form: ToolFormat) -> StructuredOutput | None:
    """The output's grammar: with tools that may be called, the tool-call grammar (with "auto" and
    a ``response_format`` or vLLM extra, either calls from the first token or the answer it asks
    for; with "required" or a named function, the calls alone, as vLLM's choice wins); else what
    ``response_format`` or vLLM's extras ask for; behind the thinking with a reasoning parser.
    Each part is checked to compile (400), on a worker thread."""
    found = await checked_output(engine, body)  # a 400 when it doesn't compile, whichever choice wins
    if choice == "none" or not body.tools:
        if found is None:
            return None
        param, grammar = found
    else:
        await _check_parameters(engine, body)
        param, grammar = "tools", form.grammar(body.tools, choice, body.parallel_tool_calls,
                                               answer=None if found is None else found[1])
    await check_compiles(engine, param, grammar)
    if thinking is not None:
        grammar = thinking.constrained(grammar)
        await check_compiles(engine, param, grammar)
    return grammar


async def _check_parameters(engine: AsyncEngine, body: ChatCompletionRequest) -> None:
    """400 naming the tool whose ``parameters`` are not an object's schema or don't compile."""
    for i, tool in enumerate(body.tools or []):
        param = f"tools.{i}.function.parameters"
        schema = parameters_schema(tool)
        if schema["type"] not in ("object", ["object"]):  # arguments are an object, as OpenAI demands
            raise APIError(400, f"{param}: a function's parameters must be a JSON schema of type "
                                f"\"object\", not {json.dumps(schema['type'])}", param=param, code="invalid_value")
        await check_compiles(engine, param, json_schema(schema, param))


def chat_logprobs(job: EngineRequest, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
    """Chat's logprobs of ``logprobs`` (each token's text, bytes and top alternatives), None when
    ``job`` asked for none; the Responses API's output_text logprobs have the same shape."""
    if job.params.logprobs is None:
        return None
    tokenizer = job.engine.tokenizer
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=lp.token, logprob=lp.logprob, bytes=token_bytes(tokenizer, lp.token_id, lp.token),
            top_logprobs=[TopLogprob(token=text, logprob=value, bytes=token_bytes(tokenizer, token_id, text))
                          for token_id, text, value in lp.top])
        for lp in logprobs or []])


def _message(text: str | None, finish_reason: str | None, calls: ToolFormat | None, reasoning: str | None
             ) -> tuple[AssistantMessage, str | None]:
    """The assistant's message, tool calls (written in ``calls``) read out of its text (the answer,
    after any thinking) when they may be there."""
    if calls is None:
        return AssistantMessage(content=text, **thought(reasoning)), finish_reason
    content, parsed = parse_tool_calls(text or "", calls.parser())
    tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                  for c in parsed]
    return (AssistantMessage(content=content, tool_calls=tool_calls, **thought(reasoning)),
            _finish(finish_reason, bool(parsed)))


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _response(chat: StartedChat, model: str, prompt_logprobs: int | None) -> ChatCompletionResponse:
    """The whole answer; with ``prompt_logprobs`` asked for, the rendered prompt's logprobs (vLLM's,
    beside the choices: every choice has the same prompt)."""
    job, choices, thought_flags = chat.job, [], []
    for c in job.choices:
        split = chat.thinking.split(c.text) if chat.thinking is not None else None
        message, reason = _message(c.text if split is None else split.content, c.finish_reason,
                                   chat.tool_format if chat.calls else None, None if split is None else split.reasoning)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=chat_logprobs(job, c.logprobs),
                                  finish_reason=reason, stop_reason=c.stop_reason))
        thought_flags.append(split is not None and split.thought)
    scored = job.choices[0].prompt_logprobs
    return ChatCompletionResponse(id=job.request_id, created=job.created, model=model, choices=choices,
                                  usage=usage_with_thinking(job, chat.thinking, thought_flags),
                                  timings=timings_of(job),
                                  prompt_logprobs=None if prompt_logprobs is None or scored is None
                                  else prompt_logprobs_of(scored, prompt_logprobs))


@dataclass
class _HeldBack:
    """What reads one choice's stream before the client sees it: the thinking's splitter (with a
    reasoning parser) and then the tool-call parser (when calls may come)."""

    splitter: ThoughtSplitter | None
    parser: ToolCallParser | CallParser | None

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """The (reasoning, content, tool-call deltas) that ``text`` releases."""
        reasoning = ""
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text, final=finished)
        tool_deltas = []
        if self.parser is not None:
            text, tool_deltas = self.parser.feed(text)
            if finished:
                text += self.parser.finish()[0]
        return reasoning, text, tool_deltas


def _chunk_choice(job: EngineRequest, delta: CompletionOutput, held: _HeldBack) -> ChatChunkChoice | None:
    reason = delta.finish_reason.value if delta.finish_reason else None
    reasoning, text, tool_deltas = held.feed(delta.text, reason is not None)
    if held.parser is not None and reason is not None:
        reason = _finish(reason, any(call.name is not None for call in held.parser.calls))
    # One event per token, even one that adds no text yet (part of a character, a possible stop
    # string's start, an id the tokenizer lacks), as vLLM does: the stream keeps the step's cadence.
    # Text a tool-call parser or the thinking's splitter holds back sends nothing, so a call's
    # message never gets content "", nor a thought an empty answer.
    holding = held.parser is not None or held.splitter is not None
    silent = not (reasoning or text or tool_deltas) if holding else not delta.token_ids
    if silent and reason is None and not delta.logprobs:
        return None
    message = DeltaMessage(
        content=text if text or not (tool_deltas or held.splitter is not None) else None, **thought(reasoning or None),
        tool_calls=[ToolCallDelta(index=d.index, id=d.id, type="function" if d.id else None,
                                  function=FunctionCallDelta(name=d.name, arguments=d.arguments))
                    for d in tool_deltas])
    return ChatChunkChoice(index=delta.index, delta=message, logprobs=chat_logprobs(job, delta.logprobs),
                           finish_reason=reason, stop_reason=delta.stop_reason)


async def _chunks(chat: StartedChat, model: str, include_usage: bool, continuous_usage: bool, legacy: bool = False
                  ) -> AsyncGenerator[str, None]:
    """The stream's chunks; with ``continuous_usage`` each carries the usage so far; with ``legacy``
    calls come as legacy function calls."""
    job = chat.job
    held = [_HeldBack(chat.thinking.splitter() if chat.thinking is not None else None,
                      chat.tool_format.parser() if chat.calls else None) for _ in range(job.params.n)]

    def usage() -> Usage:
        return usage_with_thinking(job, chat.thinking, [h.splitter is not None and h.splitter.thought for h in held])

    def chunk(choices: list[ChatChunkChoice], **extra: object) -> str:
        if continuous_usage:
            extra.setdefault("usage", usage())
        return sse_event(ChatCompletionChunk(id=job.request_id, created=job.created, model=model, choices=choices,
                                             **extra))

    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(job.params.n)])
    async with contextlib.aclosing(job.deltas()) as deltas:
        async for out in deltas:
            choices = [legacy_chunk_choice(c) if legacy else c
                       for c in (_chunk_choice(job, d, held[d.index]) for d in out.outputs) if c is not None]
            if choices or out.finished:
                yield chunk(choices, timings=timings_of(job) if out.finished else None)
    if include_usage:
        yield chunk([], usage=usage())
