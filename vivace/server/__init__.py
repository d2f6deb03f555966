"""The OpenAI-compatible HTTP server: ``build_app(engine, settings)`` and ``run_server``."""

from vivace.server.app import build_app
from vivace.server.settings import ServerSettings

__all__ = ["build_app", "ServerSettings"]
