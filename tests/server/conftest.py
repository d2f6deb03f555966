"""Fixtures of the server tests: one tiny-model engine per session, one server per module;
after every test the engine must go idle with every KV block free and its accounting intact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings

from .harness import RunningServer, assert_engine_idle, serving, serving_own_engine

MAX_MODEL_LEN = 256
LONG_RUN = 8000  # max_tokens of a request that holds the single-slot engine


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN,
                                      num_kv_blocks=128, max_num_seqs=32))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def single_slot_engine(make_tiny_llama) -> Iterator[AsyncEngine]:
    """Runs one sequence at a time, so that further requests really queue; its long context
    lets a request hold the slot for thousands of steps (LONG_RUN tokens)."""
    model = make_tiny_llama(max_position_embeddings=LONG_RUN + 64)
    engine = AsyncEngine(EngineConfig(model=str(model), num_kv_blocks=LONG_RUN // 16 + 16,
                                      max_num_seqs=1))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def default_float_engine() -> Iterator[AsyncEngine]:
    """The default model with float weights (int4 rambles past max_tokens on short questions),
    shared by the modules that check real answers; each serves it from its own server."""
    engine = AsyncEngine(EngineConfig(kv_cache_memory_gb=0.25, quantization="none", max_model_len=2048))
    yield engine
    assert_engine_idle(engine)
    engine.shutdown()


@pytest.fixture(scope="module")
def default_server(default_float_engine: AsyncEngine) -> Iterator[RunningServer]:
    with serving(default_float_engine, ServerSettings(served_model_name="smol")) as running:
        yield running
    assert_engine_idle(default_float_engine)


@pytest.fixture(scope="module")
def tools_server_module(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """The tiny model with a context that has room for the tool listing the Hermes-style
    convention puts in the prompt, on its own engine, served for one module."""
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=1024, num_kv_blocks=256)
    with serving_own_engine(config, ServerSettings(served_model_name="tiny")) as running:
        yield running


@pytest.fixture
def tools_server(tools_server_module: RunningServer) -> Iterator[RunningServer]:
    """That server; its engine idle, every KV block free, after each test."""
    yield tools_server_module
    assert tools_server_module.engine is not None
    assert_engine_idle(tools_server_module.engine)


@pytest.fixture(autouse=True)
def _engine_integrity(tiny_engine: AsyncEngine) -> Iterator[None]:
    yield
    assert_engine_idle(tiny_engine)


@pytest.fixture(scope="module")
def server(tiny_engine: AsyncEngine) -> Iterator[RunningServer]:
    with serving(tiny_engine, ServerSettings(served_model_name="tiny")) as running:
        yield running
