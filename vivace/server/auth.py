"""Bearer API-key check for the ``/v1`` routes."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from vivace.server.errors import APIError


def check_api_key(request: Request, api_keys: tuple[str, ...]) -> None:
    """Raises a 401 APIError unless ``api_keys`` is empty or the request bears one of them.

    Every key is compared in constant time, so the answer's timing reveals nothing.
    """
    if not api_keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    matched = False
    for key in api_keys:
        matched |= hmac.compare_digest(token.strip().encode(), key.encode())
    if scheme.lower() != "bearer" or not matched:
        raise APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
