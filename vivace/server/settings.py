"""HTTP-side settings of one server, apart from the engine's (``vivace.config.EngineConfig``)."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from vivace.server.reasoning import PARSERS
from vivace.server.tiers import Tier
from vivace.server.tool_formats import PARSERS as TOOL_PARSERS


@dataclass(frozen=True)
class ServerSettings:
    """Where and how the OpenAI-compatible server listens. Validated on construction.

    ``api_keys`` empty means no authentication; ``key_tiers`` gives some keys a tier, the
    others (and every request when there are no keys) are in ``default_tier``.
    ``served_model_name`` None serves the engine's own model name. ``shutdown_timeout_s``
    bounds how long SIGTERM waits for in-flight requests to finish. ``max_waiting_requests``
    bounds the requests admitted but without output yet (503 beyond); ``request_timeout_s``
    ends a request that runs longer (504). None means no bound. ``ssl_keyfile`` and
    ``ssl_certfile`` serve https; with ``ssl_ca_certs`` too, clients must present a certificate
    signed by one of those CAs (mutual TLS).
    ``ui`` serves the web playground at ``/``; ``otlp_traces_endpoint`` (an OTLP collector URL,
    None: no tracing) receives one OpenTelemetry span per request. ``allowed_origins`` are the
    web origins whose pages may call the API (CORS; ``*`` any, as vLLM and llama.cpp's server
    allow by default; empty: none but the server's own). ``reasoning_parser`` (one of
    ``vivace.server.reasoning.PARSERS``; None: off) hands a thinking model's ``<think>`` text
    out apart from its answer. ``tool_call_parser`` (one of
    ``vivace.server.tool_formats.PARSERS``) is the form the model writes tool calls in; "auto"
    reads it off the chat template.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    key_tiers: Mapping[str, Tier] = field(default_factory=dict)
    default_tier: Tier = Tier()
    max_waiting_requests: int | None = None
    request_timeout_s: float | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # given: clients must present a certificate it signed
    ui: bool = True
    otlp_traces_endpoint: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    reasoning_parser: str | None = None
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if any(not key for key in self.api_keys):
            raise ValueError("api keys must not be empty strings")
        if set(self.key_tiers) - set(self.api_keys):
            raise ValueError("every key given a tier must be an accepted api key")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs needs ssl_keyfile and ssl_certfile")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}: choose one of "
                             f"{', '.join(sorted(PARSERS))}")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}: choose one of "
                             f"{', '.join(TOOL_PARSERS)}")

    def uvicorn_tls(self) -> dict[str, object]:
        """uvicorn.Config keywords serving https as these settings ask (none for plain http)."""
        if self.ssl_certfile is None:
            return {}
        tls: dict[str, object] = {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile}
        if self.ssl_ca_certs is not None:
            tls |= {"ssl_ca_certs": self.ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return tls

    def tier_of(self, api_key: str) -> Tier:
        """The tier of an accepted key ("" when the server has no keys)."""
        return self.key_tiers.get(api_key, self.default_tier)
