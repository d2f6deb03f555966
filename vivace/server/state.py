"""What every handler of one app shares: settings, metrics, admission control and the engine
once it is ready; and who sent a request (its key, tier and deadlines)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request

from vivace.engine.deadlines import Deadlines
from vivace.server.admission import Admission
from vivace.server.errors import APIError
from vivace.server.metrics import EngineStatsCollector, ServerMetrics
from vivace.server.reasoning import ReasoningParser
from vivace.server.settings import ServerSettings
from vivace.server.tiers import Tier
from vivace.server.tool_formats import ToolFormat, load_tool_format

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from vivace.engine.async_engine import AsyncEngine
    from vivace.engine.step_timing import StepTimings

LOADING_RETRY_AFTER_S = 2  # the Retry-After of a 503 while the model loads


@functools.cache
def path_aliases(model: str) -> frozenset[str]:
    """The names a model loaded from ``model`` (a path, or a bundled model's name) answers to
    besides its served name, as vLLM serves a model under the path given on its command line:
    ``model`` as given and, where it is a path on disk, its resolved absolute path."""
    path = Path(model).expanduser()
    return frozenset({model, str(path.resolve())} if path.exists() else {model})


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its API key ("" without authentication), its tier, and the
    deadlines its requests run under."""

    api_key: str
    tier: Tier
    deadlines: Deadlines

    def priority(self, requested: int | None) -> int:
        return self.tier.priority_of(requested)


@dataclass
class ServerState:
    """Per-app state. ``engine`` is None while the model loads; handlers then answer 503.
    Raises ValueError when the settings' reasoning parser doesn't fit the engine's tokenizer."""

    settings: ServerSettings
    engine: AsyncEngine | None = None
    metrics: ServerMetrics = field(init=False)
    admission: Admission = field(init=False)
    # The reasoning parser and tool-call form of each served tokenizer, by its id (tokenizers live
    # as long as the app).
    _reasoning: dict[int, ReasoningParser] = field(init=False, default_factory=dict)
    _tool_formats: dict[int, ToolFormat] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine_metrics(),
                                     lambda: self.engine.timings if self.engine else None)
        self.admission = Admission(self.settings.max_waiting_requests, self.metrics.record_rejection)
        if self.engine is not None:
            self.reasoning_parser(self.engine)

    def caller(self, request: Request) -> Caller:
        """The sender of ``request`` (authenticated already, if the server has keys)."""
        api_key = getattr(request.state, "api_key", "")
        tier = self.settings.tier_of(api_key)
        return Caller(api_key, tier, Deadlines(tier.max_queue_delay, self.settings.request_timeout_s))

    def attach_engine(self, engine: AsyncEngine) -> None:
        """Marks the server ready: from now on requests go to ``engine``. Raises ValueError (and
        stays not ready) when the reasoning parser doesn't fit its tokenizer."""
        self.reasoning_parser(engine)
        self.engine = engine

    def reasoning_parser(self, engine: AsyncEngine) -> ReasoningParser | None:
        """The settings' reasoning parser for ``engine``'s tokenizer (None: off). Raises
        ValueError when the tokenizer lacks its think tags."""
        name = self.settings.reasoning_parser
        if name is None:
            return None
        key = id(engine.tokenizer)
        if key not in self._reasoning:
            self._reasoning[key] = ReasoningParser.load(name, engine.tokenizer)
        return self._reasoning[key]

    def tool_format(self, engine: AsyncEngine) -> ToolFormat:
        """The form ``engine``'s model writes tool calls in (the settings' parser; "auto": read off
        its chat template)."""
        key = id(engine.tokenizer)
        if key not in self._tool_formats:
            self._tool_formats[key] = load_tool_format(self.settings.tool_call_parser, engine.tokenizer)
        return self._tool_formats[key]

    def engine_metrics(self) -> Collector:
        """The engine series of ``/metrics`` (zeros while the model loads)."""
        return EngineStatsCollector(lambda: [((), self.engine.stats() if self.engine else None)])

    def unavailable(self) -> APIError | None:
        """Why ``/health`` is not 200 now, or None while the server can serve."""
        if self.engine is None:
            return _loading()
        if not self.engine.is_running:
            return APIError(503, "The engine has stopped", code="engine_dead")
        return None

    def model_name(self, requested: str | None = None) -> str:
        """The name responses carry for a request that asked for ``requested`` (one model here):
        ``requested`` when it is one the model answers to (vLLM echoes it too), else the served name."""
        assert self.engine is not None
        return requested if requested is not None and self._answers_to(requested) else self._served_name()

    def _served_name(self) -> str:
        assert self.engine is not None
        return self.settings.served_model_name or self.engine.model_name

    def _answers_to(self, model: str) -> bool:
        """Whether ``model`` names the served model: its served name or, without
        ``--served-model-name`` (vLLM then serves only the names given), the model's path."""
        assert self.engine is not None
        return model == self._served_name() or (
            self.settings.served_model_name is None and model in path_aliases(self.engine.model_path))

    def served_models(self) -> list[tuple[str, AsyncEngine]]:
        """Each served model name with an engine serving it (503 while loading)."""
        engine = self.engine_for(None)
        return [(self.model_name(), engine)]

    def engine_for(self, model: str | None, caller: Caller | None = None) -> AsyncEngine:
        """The engine serving ``model`` (None: the served one) to ``caller`` (a scaled-out
        server picks a version by its tier); 503 while loading, 404 if unknown."""
        if self.engine is None:
            raise _loading()
        if model is not None and not self._answers_to(model):
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.model_name()}'", param="model", code="model_not_found")
        return self.engine

    def engine_timings(self) -> StepTimings:
        """The served engine's recent timing events (``/debug/timings``); 503 while loading."""
        return self.engine_for(None).timings


def _loading() -> APIError:
    return APIError(503, "The model is still loading; retry shortly", code="not_ready",
                    retry_after=LOADING_RETRY_AFTER_S)


def server_state(request: Request) -> ServerState:
    """The ServerState of the app handling ``request``."""
    return request.app.state.vivace
