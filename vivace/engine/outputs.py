"""What the engine hands back: per-token deltas while streaming, whole outputs at the end."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"      # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"    # cancelled by the client or the server


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)
    rank: int | None = None  # of the token in its distribution (1: the most likely); prompt tokens only


@dataclass
class Timings:
    """Wall-clock instants (time.perf_counter seconds) of one request."""

    arrival: float
    scheduled: float | None = None  # first time the scheduler gave it tokens
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)  # instants it was preempted
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (step start, tokens)

    @property
    def queue_time(self) -> float:
        return (self.scheduled or self.arrival) - self.arrival

    @property
    def prefill_time(self) -> float:
        if self.first_token is None or self.scheduled is None:
            return 0.0
        return self.first_token - self.scheduled

    @property
    def decode_time(self) -> float:
        if self.first_token is None or self.finished is None:
            return 0.0
        return self.finished - self.first_token


@dataclass
class CompletionOutput:
    """One of the ``n`` choices of a request: cumulative for whole outputs, new for deltas."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None  # the stop string or token id that matched
    # Of ``token_ids``, those proposed from the request's prediction; and the proposed ones that
    # verification rejected (OpenAI's accepted/rejected_prediction_tokens).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass
class RequestOutput:
    """State of a request after a step. In streaming (delta) mode ``outputs`` hold only what is
    new since the previous output; otherwise they are cumulative. ``prompt_logprobs`` (asked for
    with ``SamplingParams.prompt_logprobs``): one entry per prompt token, None for the first, on
    the request's first output only (as vLLM's delta outputs; whole outputs keep it)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    timings: Timings
    error: str | None = None  # set (with ``finished``) when this request alone failed
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
