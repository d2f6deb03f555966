"""Why an engine stream can end in an error. Light to import: the server (and a Ray ingress that
holds no model) catches these without loading torch."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class EngineStepError(RuntimeError):
    """A step failed while this request was in flight; the engine itself goes on."""


class RequestFailedError(RuntimeError):
    """This request alone failed in the engine (its logits, sampling or detokenization);
    the other requests and the engine go on."""
