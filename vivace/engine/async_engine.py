"""The asyncio front of the engine. The engine loop runs in its own thread, so neither
HTTP work nor a slow client ever delays a step, and a step never blocks the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid

import torch

from vivace.config import EngineConfig, available_cores, resolve_device
from vivace.engine.core_share import CoreShare
from vivace.engine.deadlines import DeadlineQueue, Deadlines, QueueTimeoutError, RequestTimeoutError
from vivace.engine.errors import EngineDeadError, EngineStepError, RequestFailedError
from vivace.engine.llm_engine import EngineStats, LLMEngine
from vivace.engine.outputs import RequestOutput
from vivace.engine.sampling_params import SamplingParams, StructuredOutput
from vivace.engine.step_timing import StepTimings
from vivace.models import LoadedModel

logger = logging.getLogger(__name__)
# Adds and aborts applied between two steps at most: ~50 us each, a few milliseconds in all.
COMMANDS_PER_STEP = 64
# How long the engine thread waits, at most, for the event loop to send a step's tokens before it
# starts the next step (see ``AsyncEngine.delivery_wait``). At batch 1 the loop needs ~0.5 ms.
DELIVERY_WAIT_S = 0.002


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]], timings: StepTimings, sent_at: float,
             delivered: threading.Event) -> None:
    timings.record_handoff(sent_at)
    for sink, output in batch:
        sink.put_nowait(output)
    # Queued behind the steps of the stream tasks the puts woke, so it runs once they have written
    # their frames (or reached their next wait).
    asyncio.get_running_loop().call_soon(delivered.set)


def steps_fill_the_cores(device: str) -> bool:
    """Whether a step keeps every core this process may run on busy: a CPU step with as many
    threads as cores. The event loop then only gets a core by preempting a step thread, which
    the scheduler grants a slice or two late (1.5-4 ms here) and which stalls the step's other
    threads at their next barrier meanwhile."""
    return device == "cpu" and torch.get_num_threads() >= available_cores()


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Parameters of choice ``index`` of an n-choice request: one sequence each, seeds apart."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed, stop=list(params.stop),
                               stop_token_ids=list(params.stop_token_ids))


class OutputStream:
    """One request's delta outputs from ``AsyncEngine.generate``, iterated once. Its end, ``aclose``
    or ``cancel`` forgets the request's choices, aborting those not finished (so a stream closed
    before its first output, which an async generator could not notice, still frees the engine)."""

    def __init__(self, engine: AsyncEngine, request_id: str, ids: list[str], sink: asyncio.Queue) -> None:
        self._engine, self.request_id, self._ids, self._sink = engine, request_id, ids, sink
        self._remaining = set(ids)
        self._closed = False

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            item = await self._sink.get()
        except BaseException:  # cancelled while waiting: the request goes with the waiter
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self.cancel()
            raise item
        if item.finished:
            self._remaining.discard(item.request_id)
        if not self._remaining:
            self.cancel()
        return dataclasses.replace(item, request_id=self.request_id, finished=not self._remaining)

    async def aclose(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        """Forget the request's choices, aborting the unfinished ones in the engine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for sub_id in self._ids:
            self._engine._streams.pop(sub_id, None)
            if sub_id in self._remaining:
                self._engine._commands.put(("abort", sub_id))


class AsyncEngine:
    """Loads the model, warms it up, and serves ``generate`` streams from an engine thread."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        start = time.perf_counter()
        self.engine = LLMEngine(config, loaded)
        logger.info("vivace: engine built in %.1f s (model, native kernels, decode graph)",
                    time.perf_counter() - start)
        self.tokenizer = self.engine.tokenizer
        self.sampling_defaults = self.engine.sampling_defaults  # for the sampling fields a request leaves out
        self.model_name = self.engine.model_name
        self.model_path = config.model  # as given: a path, or a bundled model's name
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._deadlines = DeadlineQueue()
        # Seconds the engine thread waits after a step for the event loop to send its tokens, so
        # that a token leaves before the next step starts rather than one step late with the next
        # one (a doubled gap, then none). Only where the loop would otherwise wait for a core; the
        # loop's work costs the step the same time whether it runs before or inside it.
        device = resolve_device(config.device)
        self.cpu = device == "cpu"
        self.delivery_wait = DELIVERY_WAIT_S if steps_fill_the_cores(device) else 0.0
        # Fewer step threads while other work holds some of the cores (vivace.engine.core_share).
        self.core_share = CoreShare(torch.get_num_threads() if self.cpu and config.adaptive_threads else 1)
        self.error: BaseException | None = None
        start = time.perf_counter()
        self.warm_up()
        logger.info("vivace: warmed up in %.1f s", time.perf_counter() - start)
        self.timings = self.engine.timings
        self.timings.watch_gc()
        self._thread = threading.Thread(target=self._run, name="vivace-engine", daemon=True)
        self._thread.start()

    def warm_up(self) -> None:
        """Run a short request through every code path before declaring readiness."""
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        self.engine.add_request("warmup", [self.engine.loaded.config.bos_token_id or 0] * 8, params)
        while self.engine.has_unfinished():
            self.engine.step()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                self._expire_deadlines()
                self._share_cores()
                with self._lock:
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:  # fail the requests in flight, keep serving
                        logger.exception("engine step failed; aborting the requests in flight")
                        self._fail_in_flight(exc)
                        outputs = []
                self._deliver(outputs)
                if self.engine.device_error is not None:  # its step's requests have their errors
                    raise EngineDeadError(f"the device failed: {self.engine.device_error}")
        except BaseException as exc:  # the loop itself is broken: fail every stream, loudly
            logger.exception("engine loop died")
            self.error = exc
            self._stopped.set()
            for request_id in list(self._streams):
                self._deliver_error(request_id, exc)

    def _share_cores(self) -> None:
        threads = self.core_share.check()
        if threads is not None:
            torch.set_num_threads(threads)
            logger.info("vivace: steps on %d of %d threads (%s)", threads, self.core_share.full,
                        "other work holds cores" if threads < self.core_share.full else "the cores are free again")

    def _fail_in_flight(self, exc: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self._deliver_error(request_id, EngineStepError(f"the engine failed while serving this request: {exc}"))

    def _drain_commands(self, block: bool) -> None:
        """Apply queued adds and aborts, at most COMMANDS_PER_STEP of them (waiting for the first
        when ``block``): a burst (a batch of 20,000 prompts) is taken in over several steps, so the
        streams running meanwhile never wait for all of it at once."""
        for taken in range(COMMANDS_PER_STEP):
            try:
                command = self._commands.get(timeout=0.5) if block and not taken else self._commands.get_nowait()
            except queue.Empty:
                return
            self._apply(command)

    def _apply(self, command: tuple) -> None:
        kind, request_id, *args = command
        with self._lock:
            if kind == "add":
                prompt_ids, params, priority, arrival, deadlines = args
                try:
                    self.engine.add_request(request_id, prompt_ids, params, priority, arrival)
                except ValueError as exc:
                    self._deliver_error(request_id, exc)
                else:
                    self._deadlines.add(request_id, arrival, deadlines)
            elif kind == "abort":
                output = self.engine.abort_request(request_id)
                if output is not None:
                    self._deliver([output])

    def _expire_deadlines(self) -> None:
        """End each request past a deadline: its blocks are freed and its stream raises
        QueueTimeoutError or RequestTimeoutError."""
        with self._lock:
            for request_id, is_queue in self._deadlines.pop_expired(time.perf_counter()):
                request = self.engine.requests.get(request_id)
                if request is None or (is_queue and request.timings.scheduled is not None):
                    continue
                self.engine.abort_request(request_id)
                self._deliver_error(request_id, QueueTimeoutError(
                    "the request waited longer than its max queue delay without being scheduled")
                    if is_queue else RequestTimeoutError("the request ran past its timeout"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up per event loop per step, not one per output: each costs a syscall.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            if output.error is not None:
                self._deliver_error(output.request_id, RequestFailedError(output.error))
                continue
            stream = self._streams.get(output.request_id)
            if stream is not None:
                loop, sink, index = stream
                output.outputs[0].index = index
                batches.setdefault(loop, []).append((sink, output))
        sent_at = time.perf_counter()
        delivered = []
        for loop, batch in batches.items():
            delivered.append(threading.Event())
            loop.call_soon_threadsafe(_put_all, batch, self.timings, sent_at, delivered[-1])
        if self.delivery_wait:
            deadline = sent_at + self.delivery_wait
            for event in delivered:
                event.wait(max(deadline - time.perf_counter(), 0.0))

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream[0].call_soon_threadsafe(stream[1].put_nowait, exc)

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, deadlines: Deadlines = Deadlines()) -> OutputStream:
        """Queue the request for the engine thread now, and return the stream of delta outputs of
        all ``params.n`` choices (the last has ``finished`` True): the engine starts on it while the
        caller is still busy, say sending a streamed response's headers.

        Raises ValueError for a request that can never fit and EngineDeadError if the engine
        died (here); the stream raises QueueTimeoutError or RequestTimeoutError past one of
        ``deadlines`` (counted from this call; the request is then aborted). Closing the stream
        before its end, or ``cancel``, aborts the choices not finished.
        """
        arrival = time.perf_counter()
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        request_id = request_id or uuid.uuid4().hex
        prompt_ids = self.engine.tokenize(prompt)
        self.validate(prompt_ids, params)
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        for index, sub_id in enumerate(ids):
            self._streams[sub_id] = (loop, sink, index)
            self._commands.put(("add", sub_id, prompt_ids, choice_params(params, index), priority,
                                arrival, deadlines))
        return OutputStream(self, request_id, ids, sink)

    def compile_grammar(self, structured: StructuredOutput) -> None:
        """Raise ValueError (naming the problem) unless ``structured`` compiles. Thread-safe."""
        self.engine.grammars.compile(structured)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when the request can never be served (context, vocabulary, KV pool)."""
        self.engine.validate(prompt_ids, params)

    @property
    def weight_bytes(self) -> int:
        """Bytes of model weights as held in memory (for "bandwidth achieved")."""
        return self.engine.loaded.weight_bytes

    def abort(self, request_id: str) -> None:
        """Abort a request (all its choices) within one step. Thread-safe and idempotent."""
        for sub_id in [s for s in list(self._streams) if s == request_id or s.startswith(request_id + "-")]:
            self._commands.put(("abort", sub_id))

    def end_all(self, exc: BaseException) -> None:
        """End every open stream with ``exc`` (a shutdown past its grace): each raises it and
        aborts its request in the engine, so its response can still end cleanly. Thread-safe."""
        for request_id in list(self._streams):
            self._deliver_error(request_id, exc)

    def stats(self) -> EngineStats:
        with self._lock:
            return dataclasses.replace(self.engine.stats(), step_threads=self.core_share.threads if self.cpu else 0)

    def check_integrity(self) -> None:
        with self._lock:
            self.engine.check_integrity()

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
        self.engine.token_masks.shutdown()
        if not self._thread.is_alive():
            self.core_share.close()
        self.timings.unwatch_gc()
