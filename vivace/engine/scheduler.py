"""Continuous batching under a token budget, decode first.

Each step: every decoding request gets its next token first, then unfinished prompts get
chunks, then waiting requests are admitted in (priority, arrival) order while the budget,
``max_num_seqs`` and the KV pool allow. While any request is decoding, the prompt tokens of
a step are capped: by the pacer (``vivace.engine.pacer``: what fits the ITL target by the
measured step costs, and whether the chunk runs as rows of the compiled decode step or on the
prefill path), or at ``max_prefill_chunk`` when one is set; so a long prompt delays the
streams' next tokens by one chunk's compute at most. A step without decodes may fill the whole
budget with prompt.
When the pool cannot grow a running request, the lowest-priority, newest running request
is preempted by recompute: its blocks are freed and it waits to be computed again. Speculative
proposals never cause a preemption: when their slots are not free, they are dropped.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.pacer import LONG_RUN_ROWS, Pacer, PromptPath, PromptPlan, prompt_kilopositions
from vivace.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """Requests to run this step, each with how many of its tokens to compute."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_decode_tokens: int = 0  # of total_tokens, those of requests decoding (and verifying proposals)
    prompt_budget: int = 0  # the most prompt tokens this step could take
    prompt_kpos: float = 0.0  # its prompt tokens' positions summed, in thousands (their attention's work)
    long_run_kpos: float = 0.0  # the part of prompt_kpos in chunks the prefill kernel attends (pacer's long runs)
    prompt_path: PromptPath = PromptPath.ROWS  # how its prompt tokens run beside decode rows

    @property
    def num_prompt_tokens(self) -> int:
        return self.total_tokens - self.num_decode_tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    """Chooses each step's batch. With ``max_prefill_chunk`` set, a step that decodes takes at
    most that many prompt tokens; otherwise ``pacer`` decides, and without a pacer either, the
    whole budget may go to prompts."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk: int | None = None, pacer: Pacer | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.pacer = None if max_prefill_chunk else pacer
        self.waiting: list[tuple[tuple[int, int], Request]] = []  # heap by sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self.waiting, (request.sort_key(), request))

    def schedule(self) -> ScheduledBatch:
        """The next step's batch: decodes, then prompt chunks, then admissions."""
        batch = ScheduledBatch()
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        budget = self._schedule_running(decoding, self.max_num_batched_tokens, batch)
        plan = self._plan_prompt(batch.total_tokens, budget, prefilling)
        batch.prompt_budget, batch.prompt_path = plan.tokens, plan.path
        prompt_budget = self._schedule_running(prefilling, batch.prompt_budget, batch)
        if not batch.preempted:
            self._admit_waiting(batch, prompt_budget)
        # The pacer's model says from how many rows a riding prompt run takes the prefill kernel.
        long_run_rows = LONG_RUN_ROWS if self.pacer is None else self.pacer.model.long_run_rows
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            if request.num_tokens - request.num_computed_tokens > 1:
                kpos = prompt_kilopositions(request.num_computed_tokens, num_new)
                batch.prompt_kpos += kpos
                batch.long_run_kpos += kpos if num_new >= long_run_rows else 0.0
            else:
                batch.num_decode_tokens += num_new
        return batch

    def _plan_prompt(self, decode_tokens: int, budget: int, prefilling: list[Request]) -> PromptPlan:
        if not decode_tokens:
            return PromptPlan(budget, PromptPath.PREFILL)
        if self.pacer is None:
            return PromptPlan(min(budget, self.max_prefill_chunk or budget), PromptPath.ROWS)
        start = prefilling[0].num_computed_tokens if prefilling else 0
        return self.pacer.plan(decode_tokens, budget, self._oldest_prompt_wait(prefilling), start)

    def _oldest_prompt_wait(self, prefilling: list[Request]) -> float:
        """Seconds the longest-waiting request without a first token has waited (0 if none)."""
        unserved = [r.arrival_time for r in prefilling if r.timings.first_token is None]
        unserved += [r.arrival_time for _, r in self.waiting if r.timings.first_token is None]
        return time.perf_counter() - min(unserved) if unserved else 0.0

    def observe_step(self, batch: ScheduledBatch, seconds: float, path: PromptPath) -> None:
        """Teaches the pacer (if any) what ``batch``, run on ``path``, cost."""
        if self.pacer is not None:
            self.pacer.observe(batch.num_decode_tokens, batch.num_prompt_tokens, batch.prompt_kpos, seconds, path,
                               batch.long_run_kpos)

    def observe_decode_step(self, decode_tokens: int, seconds: float) -> None:
        """Teaches the pacer (if any) what a decode-only step of ``decode_tokens`` rows, which it did
        not plan (one queued ahead), cost."""
        if self.pacer is not None:
            self.pacer.observe(decode_tokens, 0, 0.0, seconds, PromptPath.ROWS)

    def _schedule_running(self, requests: list[Request], budget: int, batch: ScheduledBatch) -> int:
        """Give each of ``requests`` its next tokens within ``budget``; returns what is left."""
        for request in requests:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.spec_token_ids:
                # Proposals ride along only behind a request's last real token, within budget.
                room = budget - num_new if num_new == request.num_tokens - request.num_computed_tokens else 0
                del request.spec_token_ids[max(room, 0):]
                num_new += len(request.spec_token_ids)
                if not self.kv.allocate_slots(request, num_new):  # proposals take free slots, never others'
                    num_new -= len(request.spec_token_ids)
                    request.spec_token_ids, request.spec_draft_probs = [], None
            if not self._make_room(request, num_new, batch):
                continue
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return budget

    def _make_room(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Allocate slots for a running request, preempting others (or itself) as needed."""
        while not self.kv.allocate_slots(request, num_new):
            victim = max(self.running, key=Request.sort_key)
            self._preempt(victim, batch)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        self.running.remove(victim)
        if victim in batch.requests:
            i = batch.requests.index(victim)
            del batch.requests[i], batch.num_new_tokens[i]
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.spec_token_ids, victim.spec_draft_probs = [], None
        victim.num_preemptions += 1
        victim.timings.preemptions.append(time.perf_counter())
        self.num_preemptions += 1
        batch.preempted.append(victim)
        self.add(victim)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0][1]
            computed = self.kv.get_computed_blocks(request)
            num_computed = len(computed) * self.kv.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(request, num_new, computed):
                break
            heapq.heappop(self.waiting)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        else:
            entries = [e for e in self.waiting if e[1] is not request]
            if len(entries) != len(self.waiting):
                self.waiting = entries
                heapq.heapify(self.waiting)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
