"""``POST /v1/completions``: one engine request per prompt, ``n`` choices each; choice
``index`` is ``prompt_index * n + choice``, as in OpenAI's API."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vivace.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from vivace.server.errors import APIError
from vivace.server.generation import (
    ClientDisconnected, EngineRequest, merge, submitted, timings_of, unless_disconnected, usage_of)
from vivace.server.prompts import (
    completion_prompt_ids, fit_max_tokens, off_the_loop, parse_body, sampling_params)
from vivace.server.request_id import request_id_of
from vivace.server.protocol import CompletionRequest
from vivace.server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, prompt_logprobs_of
from vivace.server.sse import sse_event, sse_response
from vivace.server.structured import requested_constraint
from vivace.server.tokens import token_bytes
from vivace.server.state import server_state


async def create_completion(request: Request) -> Response:
    """OpenAI text completions; see ``vivace.server.protocol.CompletionRequest``."""
    state = server_state(request)
    body = await parse_body(request, CompletionRequest, state.metrics.work["parse"])
    caller = state.caller(request)
    engine = state.engine_for(body.model, caller)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone, as in vLLM)",
                       param="max_tokens")
    structured = await requested_constraint(engine, body)
    request_id = request_id_of(request, "cmpl-")
    jobs, echoes = [], []
    for i, prompt in enumerate(body.prompts()):
        ids = await off_the_loop(state.metrics.work["prompt"], completion_prompt_ids, engine.tokenizer, prompt,
                                 size=len(prompt) if isinstance(prompt, str) else 0)
        default = engine.sampling_defaults.get("max_tokens")
        max_tokens = fit_max_tokens(len(ids), body.requested_max_tokens(default is not None), engine.max_model_len,
                                    "prompt", default)
        params = sampling_params(body, max_tokens, body.logprobs, body.requested_prompt_logprobs(),
                                 engine.sampling_defaults)
        params.structured = structured
        jobs.append(EngineRequest(engine, state.metrics, ids, params, f"{request_id}-{i}",
                                  caller.priority(body.priority), caller.deadlines, model=state.model_name(body.model)))
        echoes.append((prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids))
                      if body.echo else "")
        await asyncio.sleep(0)  # other streams' events between prompts: 20,000 of them took ~2 s
    ticket = state.admission.admit(caller.api_key, caller.tier, jobs)
    if body.stream:
        on_close = submitted(jobs, ticket.release)
        return sse_response(_chunks(jobs, echoes, request_id, state.model_name(body.model), body.include_usage(),
                                    body.continuous_usage(), body.echo and body.logprobs is not None),
                            on_close, state.metrics.work["sse_write"])
    try:
        await unless_disconnected(request, _run_all(jobs))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        ticket.release()
    return JSONResponse(_response(jobs, echoes, request_id, state.model_name(body.model), body)
                        .model_dump(mode="json"))


async def _run_all(jobs: list[EngineRequest]) -> None:
    async with contextlib.aclosing(merge([job.deltas() for job in jobs])) as outputs:
        async for _ in outputs:
            pass


def _logprobs(job: EngineRequest, logprobs: list[TokenLogprob] | None, offset: int,
              prompt: list[TokenLogprob | None] | None = None, echo: str = "") -> CompletionLogprobs | None:
    """Completions' logprobs (with ``logprobs`` asked for): the echoed ``prompt``'s tokens, their
    text offsets from 0 in ``echo`` (the echoed text), then the generated ``logprobs``, theirs from
    ``offset``. A special token the tokenizer added (a BOS before a text prompt) is not in ``echo``:
    it takes no characters, so the offsets never run past the text."""
    num_top = job.params.logprobs
    if num_top is None:
        return None
    result = CompletionLogprobs()
    characters = _Characters()
    tokenizer = job.engine.tokenizer
    special_ids = set(getattr(tokenizer, "all_special_ids", ())) if prompt else set()
    for token_id, lp in zip(job.prompt_ids, prompt or []):
        token = tokenizer.decode([token_id]) if lp is None else lp.token
        _add_token(result, token, lp, characters.complete, num_top)
        if token_id not in special_ids or echo.startswith(token, characters.complete):
            characters.add(token_bytes(tokenizer, token_id, token))
    for lp in logprobs or []:
        _add_token(result, lp.token, lp, offset, num_top)
        offset += len(lp.token)
    return result


class _Characters:
    """Counts the characters a run of UTF-8 bytes completes, fed a token's bytes at a time: an echoed
    prompt token's offset is the characters before it (a token holding part of a character starts
    where that character does), so offsets never run past the text, whose length starts the answer's."""

    def __init__(self) -> None:
        self.complete = 0
        self._pending = 0  # continuation bytes the character begun last still needs

    def add(self, data: list[int]) -> None:
        for byte in data:
            if self._pending and byte >> 6 == 0b10:
                self._pending -= 1
                self.complete += not self._pending
            else:  # a character's first byte (or a stray byte, counted as one character)
                self._pending = 3 if byte >> 3 == 0b11110 else 2 if byte >> 4 == 0b1110 else int(byte >> 5 == 0b110)
                self.complete += not self._pending


def _add_token(result: CompletionLogprobs, token: str, lp: TokenLogprob | None, offset: int, num_top: int) -> None:
    """One token's entries; None (an echoed prompt's first token) has no logprob."""
    result.tokens.append(token)
    result.text_offset.append(offset)
    if lp is None:
        result.token_logprobs.append(None)
        result.top_logprobs.append(None)
        return
    result.token_logprobs.append(lp.logprob)
    # As in OpenAI's API (and vLLM), the chosen token is among its step's top_logprobs:
    # up to ``logprobs + 1`` entries.
    top = {text: value for _, text, value in lp.top[:num_top]}
    top.setdefault(lp.token, lp.logprob)
    result.top_logprobs.append(top)


def _response(jobs: list[EngineRequest], echoes: list[str], request_id: str, model: str,
              body: CompletionRequest) -> CompletionResponse:
    choices = [
        CompletionChoice(index=i * job.params.n + c.index, text=echo + c.text,
                         logprobs=_logprobs(job, c.logprobs, len(echo), c.prompt_logprobs if body.echo else None, echo),
                         finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                         prompt_logprobs=None if body.prompt_logprobs is None or c.prompt_logprobs is None
                         else prompt_logprobs_of(c.prompt_logprobs, body.prompt_logprobs))
        for i, (job, echo) in enumerate(zip(jobs, echoes)) for c in job.choices]
    timings = timings_of(jobs[0]) if len(jobs) == 1 else None
    return CompletionResponse(id=request_id, created=jobs[0].created, model=model, choices=choices,
                              usage=usage_of(jobs), timings=timings)


def _chunk_choice(job: EngineRequest, delta: CompletionOutput, first_index: int, echo: str) -> CompletionChoice:
    offset = len(echo) + len(job.choices[delta.index].text) - len(delta.text)  # ``delta`` is already folded in
    return CompletionChoice(
        index=first_index + delta.index, text=delta.text,
        finish_reason=delta.finish_reason.value if delta.finish_reason else None, stop_reason=delta.stop_reason,
        logprobs=_logprobs(job, delta.logprobs, offset))


async def _tagged(i: int, job: EngineRequest
                  ) -> AsyncGenerator[tuple[int, EngineRequest, RequestOutput], None]:
    async with contextlib.aclosing(job.deltas()) as deltas:
        async for out in deltas:
            yield i, job, out


async def _chunks(jobs: list[EngineRequest], echoes: list[str], request_id: str, model: str,
                  include_usage: bool, continuous_usage: bool, echo_logprobs: bool) -> AsyncGenerator[str, None]:
    """The stream's chunks; with ``continuous_usage`` each carries the usage so far (all prompts').
    The echoed prompts come first, or, with ``echo_logprobs``, each choice's with its logprobs
    once they are known (with the choice's first output)."""
    def chunk(choices: list[CompletionChoice], **extra: object) -> str:
        if continuous_usage:
            extra.setdefault("usage", usage_of(jobs))
        return sse_event(CompletionResponse(id=request_id, created=jobs[0].created, model=model, choices=choices,
                                            **extra))

    n = jobs[0].params.n
    if any(echoes) and not echo_logprobs:
        yield chunk([CompletionChoice(index=i * n + c, text=echo)
                     for i, echo in enumerate(echoes) for c in range(n)])
    async with contextlib.aclosing(merge([_tagged(i, job) for i, job in enumerate(jobs)])) as outs:
        async for i, job, out in outs:
            if echo_logprobs and out.prompt_logprobs is not None:
                yield chunk([CompletionChoice(index=i * n + delta.index, text=echoes[i],
                                              logprobs=_logprobs(job, [], 0, out.prompt_logprobs, echoes[i]))
                             for delta in out.outputs])
            choices = [_chunk_choice(job, delta, i * n, echoes[i]) for delta in out.outputs
                       if delta.token_ids or delta.finish_reason or delta.logprobs]  # one per token
            if choices or out.finished:
                yield chunk(choices, timings=timings_of(job) if out.finished else None)
    if include_usage:
        yield chunk([], usage=usage_of(jobs))
