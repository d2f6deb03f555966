"""The ingress side of the engine replicas: ``RemoteEngine`` offers what the OpenAI routes use
of an ``AsyncEngine`` (tokenizer, limits, grammar checks, ``generate`` streams, ``abort``) for
one version's replicas behind a Serve deployment handle; ``ServedModel`` picks a version by
weight and tier.

A request that fails before a replica started it (the replica died, or was not there) is sent
again, to another replica; one that fails after ends with a 503 ``replica_failed`` error (an
error event then ``[DONE]`` when streamed)."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from vivace.cluster.replica import EngineInfo, GenerateCall
from vivace.engine.async_engine import EngineDeadError
from vivace.engine.deadlines import Deadlines
from vivace.engine.grammar import GrammarCompiler
from vivace.engine.outputs import RequestOutput
from vivace.engine.sampling_params import SamplingParams, StructuredOutput
from vivace.server.errors import APIError

logger = logging.getLogger("vivace.cluster")

ATTEMPTS = 4  # sends of one request before it fails with 503 (replicas dying one after another)
_RETRY_PAUSE_S = 0.25
_LOST = (ActorDiedError, ActorUnavailableError, DeploymentUnavailableError)


@dataclass
class Placement:
    """Where one HTTP request's engine requests ran: filled in as each one starts."""

    versions: list[str] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)

    def add(self, version: str, replica: str) -> None:
        for names, name in ((self.versions, version), (self.replicas, replica)):
            if name not in names:
                names.append(name)


# Prefix-routing outcomes of this process's routers, per (deployment, outcome): prefix_hit
# (sent to the replica holding the longest cached prefix), no_prefix (no replica held one that
# covers enough of the prompt), fallback (the holder was too busy or full).
ROUTING_DECISIONS: collections.Counter[tuple[str, str]] = collections.Counter()
PLACEMENT: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("vivace_placement",
                                                                             default=None)


class RemoteEngine:
    """The engine-shaped front of one version's replicas (see the module docstring)."""

    is_running = True

    def __init__(self, handle: DeploymentHandle, version: str, info: EngineInfo) -> None:
        self.handle = handle.options(stream=True, method_name="generate")
        self.version = version
        self.tokenizer = info.tokenizer
        self.sampling_defaults = info.sampling_defaults
        self.model_name = info.model_name
        self.limits = info.limits
        self.max_model_len = info.limits.max_model_len
        self._grammars = GrammarCompiler(info.tokenizer, info.limits.vocab_size, info.eos_token_ids)
        self._streams: dict[str, DeploymentResponseGenerator] = {}

    def compile_grammar(self, structured: StructuredOutput) -> None:
        """As ``AsyncEngine.compile_grammar``, in the ingress with this version's tokenizer: raise
        ValueError (naming the problem) unless ``structured`` compiles. Thread-safe."""
        self._grammars.compile(structured)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when no replica of this version could ever serve the request."""
        self.limits.check(prompt_ids, params)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       priority: int = 0, deadlines: Deadlines = Deadlines(),
                       ) -> AsyncIterator[RequestOutput]:
        """As ``AsyncEngine.generate``, on a replica the router picks (see the module docstring)."""
        call = GenerateCall(prompt_ids, params, request_id, priority, deadlines)
        stream = await self._start(call)
        try:
            async for output in stream:
                yield output
        except RayTaskError as exc:
            raise _engine_error(exc) from None
        except _LOST:
            raise APIError(503, "The replica serving this request failed; retry it",
                           code="replica_failed", retry_after=1) from None
        finally:
            self._streams.pop(request_id, None)
            stream.cancel()

    async def _start(self, call: GenerateCall) -> DeploymentResponseGenerator:
        """Sends ``call`` until a replica has started it; returns the stream after its start."""
        for attempt in range(ATTEMPTS):
            _new_serve_request_id()
            stream = self.handle.remote(call)
            self._streams[call.request_id] = stream
            try:
                replica = await stream.__anext__()
            except RayTaskError as exc:
                if not isinstance(exc.cause, EngineDeadError):
                    raise _engine_error(exc) from None
                lost: BaseException = exc.cause
            except _LOST as exc:
                lost = exc
            else:
                placement = PLACEMENT.get()
                if placement is not None:
                    placement.add(self.version, replica)
                return stream
            logger.warning("request %s lost before it started (%s); sending it again",
                           call.request_id, type(lost).__name__)
            await asyncio.sleep(_RETRY_PAUSE_S * attempt)
        self._streams.pop(call.request_id, None)
        raise APIError(503, "No replica could start this request; retry it",
                       code="replica_failed", retry_after=1)

    def abort(self, request_id: str) -> None:
        """Cancels the request's stream, which aborts it in its replica's engine."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()


def _new_serve_request_id() -> None:
    """Gives the coming handle call an internal request id of its own. Serve would reuse the
    HTTP request's, and routers tell pending requests apart by it: the engine requests of one
    HTTP request (several prompts, or a retry) would fulfil one another's replica choices."""
    context = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(
        dataclasses.replace(context, _internal_request_id=generate_request_id()))


def _engine_error(exc: RayTaskError) -> BaseException:
    """The engine's own exception (ValueError, a deadline...) from its Ray wrapper."""
    cause = exc.cause
    return cause if isinstance(cause, BaseException) else RuntimeError(str(exc))


@dataclass
class Version:
    """One version of a served model: its engine front, share of traffic, reserved tiers."""

    engine: RemoteEngine
    weight: float
    tiers: Sequence[str] = ()
    credit: float = 0.0


class ServedModel:
    """The versions of one model name. Callers whose tier has versions reserved for it get
    those; every other caller the versions reserved for no tier. Among them, smooth weighted
    round-robin: over any run of requests each version's share is its weight's, to one request."""

    def __init__(self, name: str, versions: Sequence[Version]) -> None:
        self.name = name
        self.versions = list(versions)

    def pick(self, tier: str) -> RemoteEngine:
        eligible = ([v for v in self.versions if tier in v.tiers]
                    or [v for v in self.versions if not v.tiers])
        total = sum(v.weight for v in eligible)
        for version in eligible:
            version.credit += version.weight
        chosen = max(eligible, key=lambda v: v.credit)
        chosen.credit -= total
        return chosen.engine
