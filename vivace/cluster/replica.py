"""The engine replica: one AsyncEngine in a Ray Serve replica, streaming its outputs to the
ingress; and what crosses between them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine, EngineDeadError
from vivace.engine.deadlines import Deadlines
from vivace.engine.limits import RequestLimits
from vivace.engine.outputs import RequestOutput
from vivace.engine.sampling_params import SamplingParams
from vivace.server.metrics import timing_snapshots


@dataclass(frozen=True)
class GenerateCall:
    """One engine request sent to a replica (what ``AsyncEngine.generate`` takes). The prefix
    router reads ``prompt_ids`` from it."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    priority: int = 0
    deadlines: Deadlines = Deadlines()


@dataclass(frozen=True)
class EngineInfo:
    """What the ingress needs of a version's engine: its name, limits, tokenizer (with its chat
    template), the sampling defaults of the requests sent to it, and its end-of-sequence ids
    (the ingress compiles grammars as the engine would, to refuse one that doesn't with a 400)."""

    model_name: str
    limits: RequestLimits
    tokenizer: Any
    sampling_defaults: dict[str, float | int]
    eos_token_ids: tuple[int, ...]


class EngineReplica:
    """A Serve deployment class: loads ``config``'s model, serves ``generate`` streams, and
    reports its engine's load to the autoscaler and ``/replicas``. ``model`` is the served
    name ("" for the engine's own), ``version`` the version's."""

    def __init__(self, config: EngineConfig, model: str, version: str) -> None:
        self.engine = AsyncEngine(config)
        self.model = model or self.engine.model_name
        self.version = version
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def describe(self) -> EngineInfo:
        return EngineInfo(self.engine.model_name, self.engine.engine.limits, self.engine.tokenizer,
                          self.engine.sampling_defaults, self.engine.engine.loaded.config.eos_token_ids)

    async def generate(self, call: GenerateCall) -> AsyncIterator[str | RequestOutput]:
        """First this replica's id (the request has started here), then the engine's delta
        outputs. Cancelling the stream aborts the request in the engine."""
        if not self.engine.is_running:  # before the start: the ingress sends it elsewhere
            raise EngineDeadError(f"the engine has stopped: {self.engine.error!r}")
        yield self.replica_id
        stream = self.engine.generate(call.prompt_ids, call.params, call.request_id, call.priority, call.deadlines)
        async with contextlib.aclosing(stream):
            async for output in stream:
                yield output

    def stats(self) -> dict[str, Any]:
        """This replica's identity, its engine's EngineStats fields and its step timings."""
        return {"replica": self.replica_id, "model": self.model, "version": self.version,
                "pid": os.getpid(), "state": "RUNNING" if self.engine.is_running else "DEAD",
                **dataclasses.asdict(self.engine.stats()), "timings": timing_snapshots(self.engine.timings)}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Queue depth for the autoscaler: requests running plus waiting in the engine."""
        stats = self.engine.stats()
        return {"queue_depth": float(stats.num_running + stats.num_waiting)}

    def check_health(self) -> None:
        """Serve restarts a replica whose engine loop has died."""
        if not self.engine.is_running:
            raise RuntimeError(f"the engine has stopped: {self.engine.error!r}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)  # None when the model failed to load
        if engine is not None:
            engine.shutdown()
