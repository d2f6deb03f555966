"""One streaming request to an OpenAI-compatible server, timed as the client sees it.

Every timestamp is `time.perf_counter()` taken when a server-sent event line has been
read off the socket, so TTFT and ITL include the network and the HTTP stack, exactly
what a user of the server would feel.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Api = Literal["completions", "chat"]
OutputControl = Literal["ignore_eos", "min_tokens", "none"]


class StreamError(Exception):
    """The server sent an error event inside a stream that had started fine."""


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send requests: base URL (without /v1), API flavour, model name;
    how the output length is pinned (`ignore_eos`, `min_tokens` = `max_tokens`, or
    nothing); whether usage is asked for in the stream; extra body fields for every
    request (they win over the fields built here)."""

    base_url: str
    api: Api
    model: str
    api_key: str | None = None
    output_control: OutputControl = "ignore_eos"
    include_usage: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "/v1/completions" if self.api == "completions" else "/v1/chat/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """Timings of one request. Times are seconds; `chunk_times` are arrival offsets of
    the token-bearing chunks (`chunk_content`) from `sent_at`, so `ttft == chunk_times[0]`."""

    sent_at: float
    chunk_times: list[float] = field(default_factory=list)
    e2e: float = 0.0
    text: str = ""
    output_tokens: int = 0
    prompt_tokens: int | None = None
    expected_prompt_tokens: int | None = None
    error: str | None = None
    error_kind: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:])]


def build_body(endpoint: Endpoint, prompt: str | list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """The JSON body of a streaming request; a string prompt goes to /completions, a
    message list to /chat/completions."""
    body: dict[str, Any] = {"model": endpoint.model, "max_tokens": max_tokens, "stream": True}
    body["prompt" if endpoint.api == "completions" else "messages"] = prompt
    if endpoint.output_control == "ignore_eos":
        body["ignore_eos"] = True
    elif endpoint.output_control == "min_tokens":
        body["min_tokens"] = max_tokens
    if endpoint.include_usage:
        body["stream_options"] = {"include_usage": True}
    body.update(endpoint.extra_body)
    return body


def chunk_content(chunk: dict[str, Any]) -> str | None:
    """The generated text carried by one streamed chunk, or None where it carries no token (the
    role chunk, usage, a finish without text). A token whose text is still empty (part of a
    character, an id the tokenizer does not decode, text held back for a stop string) is an event
    of its own on servers that send one per token (vivace, vLLM): '' here, so ITL counts it. So is a
    thinking model's reasoning token (``reasoning_content``, or vLLM's newer ``reasoning``): its
    text is not the answer's, but the user waits on it as on any other token."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if "text" in choice:
        text = choice.get("text")
    else:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if not text and (delta.get("reasoning_content") or delta.get("reasoning")):
            return ""
        if "role" in delta and not text:
            return None
    if text is None or (not text and choice.get("finish_reason")):
        return None
    return text


async def stream_request(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    origin: float,
) -> RequestResult:
    """Send one streaming request and time it. Never raises for server or network
    failures: they come back as `error` and `error_kind` on the result. `origin` is the
    perf_counter value that `sent_at` is measured from."""
    started = time.perf_counter()
    result = RequestResult(sent_at=started - origin)
    body = build_body(endpoint, prompt, max_tokens)
    try:
        async with client.stream("POST", endpoint.url, json=body, headers=endpoint.headers()) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return _fail(result, f"http_{response.status_code}", detail, started)
            await _read_events(response, result, started)
    except httpx.TimeoutException as exc:
        return _fail(result, "timeout", repr(exc), started)
    except httpx.TransportError as exc:
        return _fail(result, "connection", repr(exc), started)
    except StreamError as exc:
        return _fail(result, "stream_error", str(exc), started)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return _fail(result, "bad_stream", repr(exc), started)
    result.e2e = time.perf_counter() - started
    if not result.chunk_times:
        return _fail(result, "empty_output", "stream ended without any content", started)
    if not result.output_tokens:
        result.output_tokens = len(result.chunk_times)
    return result


async def _read_events(response: httpx.Response, result: RequestResult, started: float) -> None:
    pieces: list[str] = []
    async for line in response.aiter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise StreamError(str(chunk["error"])[:300])
        content = chunk_content(chunk)
        if content is not None:
            result.chunk_times.append(now - started)
            pieces.append(content)
        usage = chunk.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens")
            result.output_tokens = usage.get("completion_tokens") or 0
    result.text = "".join(pieces)


def _fail(result: RequestResult, kind: str, detail: str, started: float) -> RequestResult:
    result.e2e = time.perf_counter() - started
    result.error_kind = kind
    result.error = detail
    return result
