"""API-key check for the ``/v1`` routes: ``Authorization: Bearer <key>`` (OpenAI's clients) or
``x-api-key: <key>`` (Anthropic's)."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from vivace.server.errors import APIError


def _presented(request: Request) -> list[bytes]:
    """The keys the request presents: its bearer token, then its ``x-api-key``."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    keys = [token.strip().encode()] if scheme.lower() == "bearer" else []
    if "x-api-key" in request.headers:
        keys.append(request.headers["x-api-key"].strip().encode())
    return keys


def check_api_key(request: Request, api_keys: tuple[str, ...]) -> str:
    """The key the request bears ("" when ``api_keys`` is empty): the first it presents that is
    one of ``api_keys``; raises a 401 APIError when none is.

    Every key is compared in constant time, so the answer's timing reveals nothing.
    """
    if not api_keys:
        return ""
    matched = ""
    for presented in reversed(_presented(request)):  # the bearer token, checked last, wins
        for key in api_keys:
            if hmac.compare_digest(presented, key.encode()):
                matched = key
    if not matched:
        raise APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                       code="invalid_api_key")
    return matched
