"""The state of one sequence inside the engine.

There is no prefill or decode phase: a request has ``num_tokens`` tokens (prompt plus
output) of which ``num_computed_tokens`` have K/V in the cache; each step the scheduler
hands it some of the difference.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vivace.engine.outputs import FinishReason, Timings, TokenLogprob
from vivace.engine.prediction import Prediction
from vivace.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_order: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(init=False)  # prompt followed by output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    # The prefix cache's chain digest of each full block hashed so far (vivace.engine.kv_cache);
    # tokens are only ever appended, so they stay valid for the request's life.
    block_hashes: list[bytes] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify next step
    spec_draft_probs: torch.Tensor | None = None  # the draft's distribution per proposal (sampling)
    spec_k: int = 0       # adaptive proposal length (0: not yet set)
    spec_misses: int = 0  # consecutive steps with nothing accepted
    spec_pause: int = 0   # steps left without speculation
    prediction: Prediction | None = None  # what proposals come from, when the request has one
    matcher: Any = None  # the grammar's state for a constrained request (vivace.engine.grammar)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = field(init=False)
    # With params.prompt_logprobs: the prompt tokens' logprobs collected so far, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = field(init=False)
    generator: torch.Generator | None = field(init=False)
    min_tokens_banned: torch.Tensor | None = None  # the ids the sampler forbids before min_tokens, once gathered
    timings: Timings = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.token_ids = list(self.prompt_token_ids)
        self.logprobs = [] if self.params.logprobs is not None else None
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None else None
        self.generator = None
        if self.params.seed is not None:
            # Any accepted seed (signed or unsigned 64-bit, plus a choice's index) maps into
            # the generator's unsigned 64-bit range.
            self.generator = torch.Generator().manual_seed(self.params.seed % 2**64)
        self.timings = Timings(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_cacheable_tokens(self) -> int:
        """How many of its first tokens the prefix cache may serve: all of them, except for a request
        still collecting prompt logprobs, which must compute every position whose logits it has not
        read yet (a cached token has no logits)."""
        if self.prompt_logprobs is None or len(self.prompt_logprobs) == self.num_prompt_tokens:
            return self.num_tokens
        return len(self.prompt_logprobs) - 1

    def prompt_logprob_positions(self, num_new: int) -> range:
        """Of the next ``num_new`` positions to compute, those whose logits give prompt logprobs not
        collected yet: the logits at position p score prompt token p + 1, in order, each once
        (after a preemption, the positions computed again before them give nothing)."""
        if self.prompt_logprobs is None:
            return range(0)
        start = self.num_computed_tokens
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + num_new, self.num_prompt_tokens - 1))

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Lower runs sooner: priority first, then arrival."""
        return (self.priority, self.arrival_order)
