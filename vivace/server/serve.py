"""Running the server process: listen at once, load the model in the background (``/health``
503 until ready), and on SIGTERM stop accepting, drain in-flight requests, exit 0."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading

import uvicorn

from vivace.config import EngineConfig
from vivace.engine.errors import EngineDeadError
from vivace.server.app import build_app
from vivace.server.settings import ServerSettings
from vivace.server.state import ServerState

logger = logging.getLogger("vivace.server")


def _load_engine(config: EngineConfig, state: ServerState, server: uvicorn.Server,
                 failures: list[BaseException]) -> None:
    from vivace.engine.async_engine import AsyncEngine
    try:
        engine = AsyncEngine(config)
    except BaseException as exc:
        logger.exception("could not load the model %r", config.model)
        failures.append(exc)
        server.should_exit = True
        return
    try:
        state.reasoning_parser(engine)
    except ValueError as exc:  # the model can't be served as the flags ask (--reasoning-parser)
        logger.error("vivace serve: %s", exc)
        engine.shutdown()
        failures.append(exc)
        server.should_exit = True
        return
    # Everything alive now (model, torch, the app) lives as long as the process: frozen, no
    # collection walks it again, so a full collection costs what the requests allocated, not
    # a 100-200 ms walk of the whole heap while streams wait.
    gc.collect()
    gc.freeze()
    state.attach_engine(engine)
    logger.info("model %r ready; tool calls: %s", state.model_name(), state.tool_format(engine).label)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, but a stream still open near the end of the shutdown grace is ended by
    the engine (an error event, then ``[DONE]``) instead of cut mid-chunk when uvicorn cancels it."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def _wait_tasks_to_complete(self) -> None:
        grace = self.config.timeout_graceful_shutdown
        if grace is None or self.state.engine is None:
            return await super()._wait_tasks_to_complete()
        try:  # the last second of the grace (half of a shorter one) is for the error events
            await asyncio.wait_for(super()._wait_tasks_to_complete(), grace - min(1.0, grace / 2))
        except asyncio.TimeoutError:
            logger.warning("shutdown: ending the streams still open")
            self.state.engine.end_all(EngineDeadError("the server is shutting down"))
            await super()._wait_tasks_to_complete()


def _keep_exit_status_zero() -> None:
    # uvicorn re-raises the signal that stopped it once it has drained; with a no-op handler in
    # place that re-raise is harmless and a SIGTERM-ed server exits 0 after a clean drain.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)


def run_server(config: EngineConfig, settings: ServerSettings) -> int:
    """Serves until SIGTERM/SIGINT; returns the process exit status (0 clean, 1 load failure)."""
    app = build_app(None, settings)
    state: ServerState = app.state.vivace
    server = _DrainingServer(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_timeout_s, lifespan="off", **settings.uvicorn_tls()), state)
    failures: list[BaseException] = []
    loader = threading.Thread(target=_load_engine, args=(config, state, server, failures),
                              name="vivace-loader", daemon=True)
    loader.start()
    _keep_exit_status_zero()
    server.run()
    tracer = getattr(app.state, "tracer", None)
    if tracer is not None:  # its last spans, before the engine's shutdown
        tracer.shutdown()
    loader.join(timeout=settings.shutdown_timeout_s)
    if state.engine is not None:
        state.engine.shutdown()
    return 1 if failures or loader.is_alive() else 0
