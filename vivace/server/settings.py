"""HTTP-side settings of one server, apart from the engine's (``vivace.config.EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    """Where and how the OpenAI-compatible server listens. Validated on construction.

    ``api_keys`` empty means no authentication. ``served_model_name`` None serves the
    engine's own model name. ``shutdown_timeout_s`` bounds how long SIGTERM waits for
    in-flight requests to finish.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if any(not key for key in self.api_keys):
            raise ValueError("api keys must not be empty strings")
