"""Fixtures for the benchmark's tests: scripted streaming servers on loopback."""

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from .scripted_server import Script, ScriptedServer


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[..., ScriptedServer]]:
    """Factory: `await scripted(ttft_s=..., ...)` starts a server, stopped at teardown."""
    servers: list[ScriptedServer] = []

    async def start(**script: object) -> ScriptedServer:
        server = ScriptedServer(Script(**script))
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
def scripted_in_thread() -> Iterator[Callable[..., ScriptedServer]]:
    """Factory for a scripted server on its own event loop in a thread, for code under
    test that runs its own loop (`asyncio.run`)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers: list[ScriptedServer] = []

    def start(**script: object) -> ScriptedServer:
        server = ScriptedServer(Script(**script))
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=10)
        servers.append(server)
        return server

    yield start
    for server in servers:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
