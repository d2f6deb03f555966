"""Bearer API-key check for the ``/v1`` routes."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from vivace.server.errors import APIError


def check_api_key(request: Request, api_keys: tuple[str, ...]) -> str:
    """The key the request bears ("" when ``api_keys`` is empty); raises a 401 APIError unless
    it is one of ``api_keys``.

    Every key is compared in constant time, so the answer's timing reveals nothing.
    """
    if not api_keys:
        return ""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    bearer = token.strip().encode()
    matched = ""
    for key in api_keys:
        if hmac.compare_digest(bearer, key.encode()):
            matched = key
    if scheme.lower() != "bearer" or not matched:
        raise APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    return matched
