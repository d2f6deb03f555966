"""Running engine requests from HTTP handlers: per-choice accumulation, abort when abandoned,
merging several requests' streams, and racing a handler against the client's disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request

from vivace.engine.deadlines import Deadlines, QueueTimeoutError, RequestTimeoutError
from vivace.engine.errors import EngineDeadError, EngineStepError, RequestFailedError
from vivace.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from vivace.engine.sampling_params import SamplingParams
from vivace.server.errors import APIError
from vivace.server.responses import CompletionTokensDetails, ResponseTimings, Usage

if TYPE_CHECKING:
    from vivace.engine.async_engine import AsyncEngine, OutputStream
    from vivace.server.metrics import ServerMetrics
    from vivace.server.reasoning import Thinking

T = TypeVar("T")
logger = logging.getLogger("vivace.server")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


@dataclass
class ChoiceState:
    """Everything one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for, from its first output
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.accepted_prediction_tokens += delta.accepted_prediction_tokens
        self.rejected_prediction_tokens += delta.rejected_prediction_tokens
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason.value, delta.stop_reason


@contextlib.contextmanager
def _engine_errors(job: EngineRequest) -> Iterator[None]:
    """The engine's errors for ``job`` as the APIError a client gets (this request only: the
    server goes on)."""
    try:
        yield
    except ValueError as exc:  # the engine refuses requests that can never fit its KV pool
        raise APIError(400, str(exc), code="invalid_request") from None
    except (RequestFailedError, EngineStepError) as exc:
        logger.warning("request %s failed in the engine: %s", job.engine_id, exc)
        raise APIError(500, f"The engine could not complete this request: {exc}",
                       code="request_failed") from None
    except EngineDeadError as exc:  # /health says 503 too
        raise APIError(503, f"The engine has stopped: {exc}", code="engine_dead") from None
    except QueueTimeoutError:
        job.metrics.record_timeout("queue")
        raise APIError(503, f"The request waited more than {job.deadlines.max_queue_delay} s "
                            "to be scheduled; retry later", code="queue_timeout", retry_after=1) from None
    except RequestTimeoutError:
        job.metrics.record_timeout("request")
        raise APIError(504, f"The request ran longer than its {job.deadlines.timeout} s timeout",
                       code="request_timeout") from None


def submitted(jobs: list[EngineRequest], release: Callable[[], None]) -> Callable[[], None]:
    """Queue ``jobs`` on the engine now, before a streamed response starts, and return what that
    response calls once it has ended: ``release`` (the admission ticket's), after abandoning any job
    it never read. A job the engine refuses abandons those queued before it, releases, and raises."""
    def on_close() -> None:
        try:
            for job in jobs:
                job.abandon()
        finally:
            release()

    try:
        for job in jobs:
            job.submit()
    except BaseException:
        on_close()
        raise
    return on_close


class EngineRequest:
    """One request on the engine for ``model`` (the name its response carries). Iterate
    :meth:`deltas` once; ``choices`` and ``last`` accumulate as it goes. Abandoning the iteration aborts the request in the engine;
    metrics are recorded when it ends either way. Past its queue delay the iteration raises
    a 503 APIError (Retry-After 1), past its timeout a 504."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, prompt_ids: list[int],
                 params: SamplingParams, request_id: str, priority: int = 0,
                 deadlines: Deadlines = Deadlines(), *, model: str) -> None:
        self.engine = engine
        self.model = model
        self.metrics = metrics
        self.prompt_ids = prompt_ids
        self.params = params
        self.request_id = request_id
        # Unique in the engine even when clients reuse an X-Request-Id; log lines show both.
        self.engine_id = f"{request_id}.{uuid.uuid4().hex[:8]}"
        self.priority = priority
        self.created = int(time.time())  # every chunk of its answer carries this one timestamp, as OpenAI's do
        self.deadlines = deadlines
        self.choices = [ChoiceState(i) for i in range(params.n)]
        self.last: RequestOutput | None = None
        self.error: APIError | None = None  # why the engine could not complete it, if it failed
        self._stream: OutputStream | None = None
        self._started = False  # deltas began (or abandon ran): the stream is theirs to close
        try:
            engine.validate(prompt_ids, params)
        except ValueError as exc:  # e.g. more KV cache than the whole pool: a 400 before any stream starts
            raise APIError(400, str(exc), param=getattr(exc, "param", None), code="invalid_request") from None

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def submit(self) -> None:
        """Queue the request on the engine now (``deltas`` does it otherwise, when it starts): a
        streamed response does it before its headers go out, so the prompt's step does not wait
        for them. Raises APIError as ``deltas`` would (a dead engine: 503); idempotent."""
        if self._stream is None:
            with _engine_errors(self):
                self._stream = self.engine.generate(self.prompt_ids, self.params, self.engine_id, self.priority,
                                                    self.deadlines)

    def abandon(self) -> None:
        """Abort a submitted request whose ``deltas`` never started (their end aborts the others),
        and record it; nothing otherwise."""
        if self._stream is not None and not self._started:
            self._started = True
            cancel = getattr(self._stream, "cancel", None)  # a remote engine's stream: not started yet
            if cancel is not None:
                cancel()
            self._record()

    def _record(self) -> None:
        """Record the request in the metrics, its unfinished choices ended as aborted."""
        if not self.finished:
            for choice in self.choices:
                choice.finish_reason = choice.finish_reason or "abort"
        self.metrics.record_request(self)

    async def deltas(self) -> AsyncGenerator[RequestOutput, None]:
        """The engine's delta outputs, each already folded into ``choices``."""
        if self._started:
            raise RuntimeError(f"request {self.engine_id} is iterated twice")
        self._started = True
        try:
            self.submit()
            with _engine_errors(self):
                async with contextlib.aclosing(self._stream) as stream:
                    async for out in stream:
                        for delta in out.outputs:
                            self.choices[delta.index].add(delta)
                            if out.prompt_logprobs is not None:
                                self.choices[delta.index].prompt_logprobs = out.prompt_logprobs
                        self.metrics.record_output(out, first=self.last is None)
                        self.last = out
                        yield out
        except APIError as exc:
            self.error = exc
            raise
        finally:
            if not self.finished:
                self.engine.abort(self.engine_id)
            self._record()

    async def run(self) -> EngineRequest:
        """Runs to the end and returns itself."""
        async for _ in self.deltas():
            pass
        return self


def usage_of(jobs: list[EngineRequest]) -> Usage:
    """Token counts summed over ``jobs``."""
    usage = Usage()
    for job in jobs:
        usage.add(len(job.prompt_ids), job.completion_tokens,
                  job.last.num_cached_tokens if job.last else 0)
    return usage


def usage_with_thinking(job: EngineRequest, thinking: Thinking | None, thought: list[bool]) -> Usage:
    """The job's usage; with a reasoning parser, its thinking tokens too (``thought``: whether each
    choice had a think block); with a prediction, its proposed tokens accepted and rejected."""
    usage = usage_of([job])
    if thinking is None and job.params.prediction is None:
        return usage
    details = usage.completion_tokens_details = CompletionTokensDetails()
    if thinking is not None:
        details.reasoning_tokens = sum(thinking.reasoning_tokens(choice.token_ids, had)
                                       for choice, had in zip(job.choices, thought))
    if job.params.prediction is not None:
        details.accepted_prediction_tokens = sum(choice.accepted_prediction_tokens for choice in job.choices)
        details.rejected_prediction_tokens = sum(choice.rejected_prediction_tokens for choice in job.choices)
    return usage


def timings_of(job: EngineRequest) -> ResponseTimings | None:
    """The job's timings once it has produced output."""
    if job.last is None:
        return None
    return ResponseTimings.of(job.last, job.completion_tokens, job.params.n)


async def run_whole(request: Request, job: EngineRequest, release: Callable[[], None]) -> bool:
    """Runs ``job`` to its end, then calls ``release``; False (the job aborted) if the client
    disconnected first."""
    try:
        await unless_disconnected(request, job.run())
    except ClientDisconnected:
        return False
    finally:
        release()
    return True


async def merge(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
    """Items of all ``streams`` as they come. Closing the merged stream closes them all;
    the first stream to fail closes the others and its exception is raised."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for item in streams[0]:
                yield item
        return
    queue: asyncio.Queue[tuple[bool, T | BaseException | None]] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((False, item))
            queue.put_nowait((True, None))
        except Exception as exc:  # re-raised in the consumer
            queue.put_nowait((True, exc))

    tasks = []
    try:
        for stream in streams:  # started one per turn of the event loop: each submits its request
            tasks.append(asyncio.ensure_future(pump(stream)))
            await asyncio.sleep(0)
        for _ in range(len(tasks)):
            while True:
                done, item = await queue.get()
                if done:
                    break
                yield item  # type: ignore[misc]
            if isinstance(item, BaseException):
                raise item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has closed its connection (needs the body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``; if the client disconnects first, cancels it and raises ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
