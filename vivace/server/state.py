"""What every handler of one app shares: settings, metrics and the engine once it is ready."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from vivace.server.errors import APIError
from vivace.server.metrics import ServerMetrics
from vivace.server.settings import ServerSettings

if TYPE_CHECKING:
    from vivace.engine.async_engine import AsyncEngine


@dataclass
class ServerState:
    """Per-app state. ``engine`` is None while the model loads; handlers then answer 503."""

    settings: ServerSettings
    engine: AsyncEngine | None = None
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine else None)

    def attach_engine(self, engine: AsyncEngine) -> None:
        """Marks the server ready: from now on requests go to ``engine``."""
        self.engine = engine

    def model_name(self) -> str:
        assert self.engine is not None
        return self.settings.served_model_name or self.engine.model_name

    def engine_for(self, model: str | None) -> AsyncEngine:
        """The engine serving ``model`` (None: the served one); 503 while loading, 404 if unknown."""
        if self.engine is None:
            raise APIError(503, "The model is still loading; retry shortly", code="not_ready")
        if model is not None and model != self.model_name():
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.model_name()}'", param="model", code="model_not_found")
        return self.engine


def server_state(request: Request) -> ServerState:
    """The ServerState of the app handling ``request``."""
    return request.app.state.vivace
