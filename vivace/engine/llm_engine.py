"""The synchronous engine core: add requests, step, read outputs. Not thread-safe;
``AsyncEngine`` drives it from one thread."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vivace.config import EngineConfig, resolve_device
from vivace.engine import backend
from vivace.engine.detokenizer import IncrementalDetokenizer
from vivace.engine.draft import DraftProposer
from vivace.engine.grammar import GrammarCompiler, TokenMasks, advance
from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.limits import RequestLimits
from vivace.engine.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from vivace.engine.pacer import Pacer, PromptPath, pacer_for
from vivace.engine.prediction import MATCH_TOKENS, Prediction, prediction_adaptive_k
from vivace.engine.request import Request
from vivace.engine.sampler import DeviceSamples, SampledTokens, Sampler, before_min_tokens, score_tokens
from vivace.engine.sampling_params import SamplingParams
from vivace.engine.scheduler import ScheduledBatch, Scheduler
from vivace.engine.speculative import AdaptiveK, SpecStats, propose_ngram
from vivace.engine.step_timing import StepTimings
from vivace.engine.stop_strings import StopStrings
from vivace.engine.tokenization import encoder_of
from vivace.generation_config import served_defaults
from vivace.layers.packed_linear import prepack_linears
from vivace.models import LoadedModel, load_model

if TYPE_CHECKING:
    from vivace.gpu.runner import Launched

logger = logging.getLogger(__name__)


class NonFiniteLogitsError(ValueError):
    """A request's logits hold NaN or infinity: its forward went wrong, not its sampling."""

    def __init__(self, message: str = "the model produced non-finite logits") -> None:
        super().__init__(message)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_queries: int
    prefix_hits: int
    spec_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    prediction_accepted: int = 0  # of the above, tokens proposed from requests' predictions (emitted)
    prediction_rejected: int = 0
    step_threads: int = 0  # the CPU threads steps run on now (AsyncEngine; 0 where not told)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        start = time.perf_counter()
        if loaded is None:
            self.loaded = backend.load(config)
        else:
            self.loaded = loaded
            backend.prepare(loaded, resolve_device(config.device))
        logger.info("vivace: model %s loaded in %.1f s", self.loaded.name, time.perf_counter() - start)
        self.tokenizer = self.loaded.tokenizer
        encoder_of(self.tokenizer)  # its check against the tokenizer's encode, here and not in a first request
        if config.chat_template is not None:
            self.tokenizer.chat_template = config.chat_template
        self.sampling_defaults = served_defaults(config, self.loaded.source)
        model_len = self.loaded.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        num_blocks = backend.num_kv_blocks(config, self.loaded, self.max_model_len)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = backend.make_runner(config, self.loaded, num_blocks, self.max_model_len,
                                          loaded_from_config=loaded is None)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_chunk, self._new_pacer())
        self.timings = StepTimings()
        self.sampler = Sampler(self.loaded.config.eos_token_ids, config.seed)
        self.spec_stats = SpecStats()
        # n-gram proposals cost nothing to make; a draft's cost a forward per token.
        self.adaptive_k = AdaptiveK(config.num_speculative_tokens, shrink=config.speculative != "ngram")
        self.prediction_k = prediction_adaptive_k()
        self.prediction_totals = [0, 0]  # tokens proposed from predictions: accepted (emitted), rejected
        self.draft: DraftProposer | None = None
        if config.speculative and config.speculative.startswith("draft:"):
            draft_path = config.speculative.removeprefix("draft:")
            try:
                draft_model = load_model(draft_path, config.torch_dtype, config.quantization,
                                         max_model_len=self.max_model_len)
            except ValueError as exc:  # e.g. a shorter context than the target's
                raise ValueError(f"the draft model {draft_path}: {exc}") from None
            prepack_linears(draft_model.model)
            self.draft = DraftProposer(draft_model, num_blocks, config.block_size, config.torch_dtype,
                                       self.loaded.config.vocab_size)
        vocab_size, eos = self.loaded.config.vocab_size, self.loaded.config.eos_token_ids
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size, eos)
        self.token_masks = TokenMasks(vocab_size)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._stop_strings: StopStrings | None = None  # the last request's, for its other choices
        self._arrivals = itertools.count()
        # A step the runner has queued on its device whose tokens the host has not read yet.
        self._inflight: Launched | None = None
        # Set when a step failed in a way that leaves the device unusable (a CUDA error is sticky:
        # every later launch fails too); the serving loop then stops and reports it.
        self.device_error: Exception | None = None

    @property
    def model_name(self) -> str:
        return self.loaded.name

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encoder_of(self.tokenizer)(prompt, False)
        return list(prompt)

    def _new_pacer(self) -> Pacer | None:
        """The pacer for this runner's steps: where every prompt chunk runs the eager step
        (``eager_prompt_steps``: the CUDA runner), with no rows path, that step filled, and its
        tokens rounded up to the runner's prompt-step graph buckets (``prompt_step_buckets``)."""
        if getattr(self.runner, "eager_prompt_steps", False):
            return pacer_for(self.config, 0, fill_eager=True,
                             token_buckets=getattr(self.runner, "prompt_step_buckets", ()))
        return pacer_for(self.config, self.runner.compiled_rows, long_run_rows=self.runner.prefill_run_rows)

    @property
    def _overlaps(self) -> bool:
        """Whether steps are queued on the runner's device ahead of their tokens' reading."""
        return self.config.overlap_schedule and hasattr(self.runner, "launch")

    @property
    def limits(self) -> RequestLimits:
        """What this engine can ever serve: vocabulary, context length, KV pool."""
        return RequestLimits(self.loaded.config.vocab_size, self.max_model_len, self.kv.block_size,
                             len(self.kv.blocks))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when the request can never be served."""
        self.limits.check(prompt_token_ids, params)
        if params.structured is not None:
            self.grammars.compile(params.structured)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None) -> Request:
        """Queue a request. Raises ValueError for a duplicate id or a request that can't fit."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
        request = Request(request_id, token_ids, params, priority, next(self._arrivals),
                          arrival_time or time.perf_counter())
        if params.structured is not None:
            request.matcher = self.grammars.compile(params.structured)
        if params.prediction and self._may_speculate(request):
            request.prediction = Prediction(params.prediction)
        self.requests[request_id] = request
        if self._stop_strings is None or self._stop_strings.stops != params.stop:  # a request's choices come in a row
            self._stop_strings = StopStrings(params.stop)
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, token_ids, self._stop_strings, params.skip_special_tokens,
            params.include_stop_str_in_output)
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now, freeing its blocks; None if it is unknown or already done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._end(request, FinishReason.ABORT)

    def _end(self, request: Request, reason: FinishReason, error: str | None = None,
             poisoned: bool = False) -> RequestOutput:
        """Finish ``request`` now (``error`` says why it failed, if it did); its blocks return
        to the pool, cleared and out of the prefix cache if its forward went ``poisoned``."""
        if poisoned:
            self.runner.clear_blocks(self.kv.forget(request))
        request.finish_reason = reason
        request.timings.finished = time.perf_counter()
        self._release(request)
        delta = CompletionOutput(0, "", [], [] if request.logprobs is not None else None, reason)
        output = self._output(request, delta, finished=True)
        output.error = error
        return output

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch; return a delta output for every token emitted (several for a request
        whose proposals were accepted, so clients still see one token per chunk).

        A failure that belongs to one request (a non-finite logit in its rows, its sampling, its
        detokenization or stop strings) ends that request alone, with an output whose ``error``
        is set; every other request gets its tokens as if it were not there. A failed forward
        ends the requests of this step that way; the engine goes on with the next step.

        With a runner that can ``launch`` (the CUDA runner) and ``overlap_schedule``, a step whose
        requests all draw on the device is queued, and before its tokens are read the next
        decode step is queued too when the batch would not change (``_launch_ahead``): the
        host emits step n's tokens while the device runs step n + 1, whose input ids never
        leave the device. A request that stops at step n has a row in step n + 1 whose token is
        dropped: stops are seen one step late, but nothing past a stop is sent."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            now = time.perf_counter()
            return self._finish_launched(launched, None, [now, now])
        if getattr(self.runner, "pending_compile", None) is not None and self.runner.swap_in_compiled():
            # Compiled steps cost differently, and prompt chunks may now ride them: relearn.
            self.scheduler.pacer = None if self.scheduler.pacer is None else self._new_pacer()
        marks = [time.perf_counter()]
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.perf_counter()
        marks.append(now)
        plan, prompt_plan, logit_indices = self._plan_logits(batch, now)
        constrained = [(request, row) for request, row, _ in plan if request.matcher is not None]
        masks = self.token_masks.fill_async([r.matcher for r, _ in constrained]) if constrained else None
        path = self.runner.path(batch)
        # Prompt rows are read on the host, so their step's tokens are drawn there too.
        on_device = not prompt_plan and self._samples_on_device(plan)
        if self._overlaps and masks is None and len(plan) == len(batch.requests) and on_device:
            try:
                launched = self.runner.launch(batch, self.kv, logit_indices, [request for request, _, _ in plan])
            except Exception as exc:
                return self._fail_step(batch.requests, exc)
            return self._finish_launched(launched, (batch, path), marks)
        try:
            if on_device:
                logits, drawn = None, self.runner.execute_sampled(batch, self.kv, logit_indices,
                                                                  [request for request, _, _ in plan])
            else:
                logits, drawn = self.runner.execute(batch, self.kv, logit_indices), None
        except Exception as exc:
            if masks is not None:
                masks.exception()  # let the mask worker finish with these requests' matchers
            return self._fail_step(batch.requests, exc)
        finite: list[bool] = []  # per logits row (the device checks its draws' rows itself)
        if drawn is None:
            # A row's sum is finite exactly when each of its logits is (NaN and inf propagate; sane
            # logits can't overflow float32): one read of the rows, taken before masks add -inf.
            finite = torch.isfinite(logits.sum(-1)).tolist() if logits is not None else []
            if masks is not None:  # filled while the forward ran
                self.token_masks.apply(logits, [row for _, row in constrained], masks.result())
        marks.append(time.perf_counter())
        samples = self._step_samples(batch, plan, prompt_plan, logits, finite, drawn)
        marks.append(time.perf_counter())
        outputs = self._emit_all(samples)
        marks.append(time.perf_counter())
        self._settle(batch.requests)
        self._propose()
        marks.append(time.perf_counter())
        self.timings.record_step(marks, batch.num_decode_tokens, batch.num_prompt_tokens, batch.prompt_budget,
                                 path.value)
        self.scheduler.observe_step(batch, marks[-1] - marks[0], path)
        return outputs

    @staticmethod
    def _plan_logits(batch: ScheduledBatch, now: float
                     ) -> tuple[list[tuple[Request, int, int]], list[tuple[Request, int, int]], list[int]]:
        """The logits rows of this step, as flat token indices; and per request, its first row in
        them and how many: ``plan``, of the requests that sample (the last row, and a row per
        proposal to verify); ``prompt_plan``, of those scoring their prompt, the positions whose
        logits they have not read (``Request.prompt_logprob_positions``). Notes each request's
        first scheduling and prompt chunk in its timings."""
        plan: list[tuple[Request, int, int]] = []
        prompt_plan: list[tuple[Request, int, int]] = []
        logit_indices: list[int] = []
        offset = 0
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            if request.timings.scheduled is None:
                request.timings.scheduled = now
            if request.num_tokens - request.num_computed_tokens > 1:
                request.timings.prefill_chunks.append((now, num_new))
            if request.prompt_logprobs is not None and (positions := request.prompt_logprob_positions(num_new)):
                prompt_plan.append((request, len(logit_indices), len(positions)))
                logit_indices.extend(offset + p - request.num_computed_tokens for p in positions)
            offset += num_new
            num_spec = len(request.spec_token_ids)
            if request.params.max_tokens and request.num_computed_tokens + num_new == request.num_tokens + num_spec:
                plan.append((request, len(logit_indices), num_spec + 1))
                logit_indices.extend(range(offset - 1 - num_spec, offset))
        return plan, prompt_plan, logit_indices

    def _step_samples(self, batch: ScheduledBatch, plan: list[tuple[Request, int, int]],
                      prompt_plan: list[tuple[Request, int, int]], logits: torch.Tensor | None, finite: list[bool],
                      drawn: DeviceSamples | None) -> list[tuple[Request, SampledTokens | Exception | None]]:
        """After the forward: what each request gets this step (``_emit_all``). Prompt chunks that
        sample nothing count as computed, and a request for no tokens whose whole prompt now is
        gets None; prompt logprobs are collected; a request whose prompt rows failed gets the
        exception instead of its tokens."""
        sampling = {request.request_id for request, _, _ in plan}
        samples: list[tuple[Request, SampledTokens | Exception | None]] = []
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            if request.request_id not in sampling:
                request.num_computed_tokens += num_new
                if request.num_computed_tokens == request.num_tokens:
                    samples.append((request, None))
        # Prompt rows are read before sampling, which may change its own rows of ``logits`` in place.
        failed = self._collect_prompt_logprobs(prompt_plan, logits, finite) if prompt_plan else None
        samples += self._sample(plan, logits, finite) if drawn is None else self._drawn(plan, drawn)
        if not failed:
            return samples
        return [(request, failed.pop(request, sampled)) for request, sampled in samples] + list(failed.items())

    def _fail_step(self, requests: list[Request], exc: Exception) -> list[RequestOutput]:
        """A forward failed: end its requests (still live ones) with an error; their blocks,
        which it may have written garbage into, are cleared and leave the prefix cache. A
        failure the runner calls a ``device_fault`` sets ``device_error``."""
        logger.error("the forward failed; ending the %d requests of this step", len(requests), exc_info=exc)
        device_fault = getattr(self.runner, "device_fault", None)
        if device_fault is not None and device_fault(exc):
            self.device_error = exc
            logger.critical("the device is unusable after this failure: the engine stops serving")
        return [self._end(request, FinishReason.ABORT, f"the engine step failed: {exc}",
                          poisoned=self.device_error is None)  # nothing more runs on a failed device
                for request in requests if request.request_id in self.requests]

    def _finish_launched(self, launched: Launched, scheduled: tuple[ScheduledBatch, PromptPath] | None,
                         marks: list[float]) -> list[RequestOutput]:
        """Queue the step after ``launched`` if it can go ahead, then read and emit ``launched``'s
        tokens. ``scheduled``: the batch ``launched`` ran and its path, when the scheduler chose
        it; None for a step launched ahead."""
        try:
            ahead = self._launch_ahead(launched)
            drawn = self.runner.collect(launched)
        except Exception as exc:
            return self._fail_step(launched.requests, exc)
        self._inflight = ahead
        marks.append(time.perf_counter())
        live = [(i, request) for i, request in enumerate(launched.requests) if request.request_id in self.requests]
        samples = [(request, drawn.tokens.row(i) if drawn.finite[i] else NonFiniteLogitsError())
                   for i, request in live]  # a request aborted since its launch gets nothing
        marks.append(time.perf_counter())
        outputs = self._emit_all(samples)
        marks.append(time.perf_counter())
        self._settle([request for _, request in live])
        self._propose()  # with speculation on, nothing was launched ahead
        marks.append(time.perf_counter())
        if scheduled is None:
            self.timings.record_step(marks, len(launched.requests), 0, 0, "rows")
            # A decode step queued ahead: from this call to its tokens read is one step of the
            # pipeline. The pacer learns decode-only costs from these (on the GPU nearly all are).
            self.scheduler.observe_decode_step(len(launched.requests), marks[-1] - marks[0])
        else:
            batch, path = scheduled
            self.timings.record_step(marks, batch.num_decode_tokens, batch.num_prompt_tokens, batch.prompt_budget,
                                     path.value)
            self.scheduler.observe_step(batch, marks[-1] - marks[0], path)
        return outputs

    def _launch_ahead(self, launched: Launched) -> Launched | None:
        """Queue the decode step after ``launched`` (``CudaRunner.launch_next``), or None when the
        scheduler might choose another batch: a request waits to be admitted, or runs without a
        row in ``launched``; or when a row needs the host's view of its tokens first: penalties
        (their history), a grammar, speculation (a prediction's too). Requests that surely finish at ``launched``'s
        token (max_tokens, the context) are left out; the K/V slot of each other one's next
        token is allocated now (None, with nothing to undo, if the pool is short)."""
        if self.scheduler.waiting or self.config.speculative is not None or self._predicting():
            return None
        live = [request for request in launched.requests if request.request_id in self.requests]
        if len(live) != len(self.scheduler.running):
            return None
        going_on = [request for request in live
                    if request.num_output_tokens + 1 < request.params.max_tokens
                    and request.num_tokens + 1 < self.max_model_len]
        if not going_on or any(r.params.has_penalties or r.matcher is not None for r in going_on) \
                or not self.runner.samples_on_device(going_on):
            return None
        for request in going_on:  # slots up to and including the token ``launched`` draws
            if not self.kv.allocate_slots(request, request.num_tokens + 1 - request.num_computed_tokens):
                return None
        return self.runner.launch_next(launched, going_on, self.kv)

    def _emit_all(self, samples: list[tuple[Request, SampledTokens | Exception | None]]) -> list[RequestOutput]:
        """Each request's output of this step: its sampled tokens, its failure, or (None) the end
        of a request for no tokens whose prompt is computed."""
        outputs: list[RequestOutput] = []
        for request, sampled in samples:
            try:
                if isinstance(sampled, Exception):
                    raise sampled
                outputs.extend(self._emit(request, sampled) if sampled is not None else [self._end_after_prompt(request)])
            except Exception as exc:  # this request's own fault: it alone ends
                logger.error("request %s failed", request.request_id, exc_info=exc)
                outputs.append(self._end(request, FinishReason.ABORT, f"this request failed: {exc}",
                                         poisoned=isinstance(exc, NonFiniteLogitsError)))
        return outputs

    def _settle(self, requests: list[Request]) -> None:
        """After a step: cache the blocks its requests filled, release the finished ones, give
        back slots no token needs."""
        for request in requests:
            if request.request_id not in self.requests:
                continue  # failed above: released, and nothing it computed this step is cached
            self.kv.cache_full_blocks(request)
            if request.finish_reason is not None:
                self._release(request)
            else:
                self.kv.trim(request, request.num_tokens)

    def _sample(self, plan: list[tuple[Request, int, int]], logits: torch.Tensor | None, finite: list[bool]
                ) -> list[tuple[Request, SampledTokens | Exception]]:
        """Sample plain rows together; verify each request's proposals on its own rows. A request
        whose rows held a non-finite logit (``finite`` per row), or whose sampling raises, gets
        the exception instead."""
        if not plan:
            return []
        results: list[tuple[Request, SampledTokens | Exception]] = []
        plain = []
        for request, row, num_rows in plan:
            if not all(finite[row:row + num_rows]):
                results.append((request, NonFiniteLogitsError()))
            elif num_rows == 1:
                plain.append((request, row))
            else:
                results.append((request, self._verify(request, logits[row:row + num_rows])))
        return self._sample_plain(plain, logits) + results

    def _collect_prompt_logprobs(self, prompt_plan: list[tuple[Request, int, int]], logits: torch.Tensor,
                                 finite: list[bool]) -> dict[Request, Exception]:
        """Append to each request's prompt logprobs those its rows of ``logits`` score (in order:
        ``Request.prompt_logprob_positions``). A request whose rows held a non-finite logit, or
        whose scoring raises, is returned with the exception (it alone fails)."""
        failed: dict[Request, Exception] = {}
        for request, row, num_rows in prompt_plan:
            if not all(finite[row:row + num_rows]):
                failed[request] = NonFiniteLogitsError()
                continue
            first = len(request.prompt_logprobs)
            token_ids = request.prompt_token_ids[first:first + num_rows]
            try:
                scored, ranks = score_tokens(logits[row:row + num_rows], token_ids, request.params.prompt_logprobs)
                request.prompt_logprobs.extend(self._token_logprob(token_id, scored, i, ranks[i])
                                               for i, token_id in enumerate(token_ids))
            except Exception as exc:
                failed[request] = exc
        return failed

    def _samples_on_device(self, plan: list[tuple[Request, int, int]]) -> bool:
        """Whether the runner draws this step's tokens itself: it can (the CUDA runner), no request
        has proposals to verify, and the runner serves every request's parameters (else the host
        sampler draws from logits, as on CPU)."""
        supports = getattr(self.runner, "samples_on_device", None)
        return (supports is not None and bool(plan) and all(num_rows == 1 for _, _, num_rows in plan)
                and supports([request for request, _, _ in plan]))

    @staticmethod
    def _drawn(plan: list[tuple[Request, int, int]], drawn: DeviceSamples
               ) -> list[tuple[Request, SampledTokens | Exception]]:
        """The runner's draws, one row per request of ``plan``; a row whose logits were not finite
        fails its request as on the host path."""
        return [(request, drawn.tokens.row(i) if drawn.finite[i] else NonFiniteLogitsError())
                for i, (request, _, _) in enumerate(plan)]

    def _sample_plain(self, plain: list[tuple[Request, int]], logits: torch.Tensor
                      ) -> list[tuple[Request, SampledTokens | Exception]]:
        """One sampler call for all rows; if it raises, each row alone, so that the failure
        lands on the request it belongs to."""
        if not plain:
            return []
        requests = [request for request, _ in plain]
        rows = [row for _, row in plain]
        # Consecutive rows (nearly always) as a view: an index copy of a row cost ~40 us on a CPU.
        picked = logits[rows[0]:rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else logits[rows]
        try:
            sampled = self.sampler(picked, requests)
        except Exception as exc:
            if len(plain) == 1:
                return [(requests[0], exc)]
            return [result for one in plain for result in self._sample_plain([one], logits)]
        return [(request, sampled.row(i)) for i, request in enumerate(requests)]

    def _verify(self, request: Request, logits: torch.Tensor) -> SampledTokens | Exception:
        proposal = request.spec_token_ids
        try:
            sampled = self.sampler.verify(logits, request, proposal)
        except Exception as exc:
            return exc
        self._record_speculation(request, len(proposal), len(sampled.token_ids) - 1)
        request.spec_token_ids, request.spec_draft_probs = [], None
        return sampled

    def _record_speculation(self, request: Request, proposed: int, accepted: int) -> None:
        self.spec_stats.num_steps += 1
        self.spec_stats.num_proposed += proposed
        self.spec_stats.num_accepted += accepted
        if request.prediction is not None and request.prediction.proposing:
            request.prediction.record(self.prediction_k, proposed, accepted)
        else:
            self.adaptive_k.update(request, proposed, accepted)

    def _predicting(self) -> bool:
        """Whether a running request has a prediction and few enough are running to speculate."""
        running = self.scheduler.running
        return len(running) <= self.config.speculative_max_batch and any(r.prediction is not None for r in running)

    @staticmethod
    def _may_speculate(request: Request) -> bool:
        """Whether nothing about the request rules speculation out: it allows it, and its rows need
        no processing that verification lacks (penalties, a grammar)."""
        params = request.params
        return params.speculative and not params.has_penalties and params.structured is None

    def _propose(self) -> None:
        """Queue proposals for the next step, when few requests are decoding: from a request's
        prediction where its output is found in it, else n-gram or draft ones (with ``speculative``)."""
        if (self.config.speculative is None and not self._predicting()) or self._inflight is not None:
            return  # nothing to propose, or a step queued ahead holds tokens the host has not read
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        if len(decoding) > self.config.speculative_max_batch:
            return
        chosen, ks = [], []
        for request in decoding:
            params = request.params
            if not self._may_speculate(request) or request.matcher is not None or before_min_tokens(request):
                continue
            room = min(params.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
            if request.prediction is not None:
                tail = request.token_ids[max(request.num_prompt_tokens, request.num_tokens - MATCH_TOKENS):]
                request.spec_token_ids = request.prediction.propose(tail, request.num_output_tokens,
                                                                    self.prediction_k, room)
                if request.spec_token_ids:
                    continue
            if self.config.speculative is None:
                continue
            k = min(self.adaptive_k.next_k(request), room)
            if k > 0:
                chosen.append(request)
                ks.append(k)
        if self.draft is not None:
            self.draft.propose(chosen, ks, self.sampler)
        else:
            for request, k in zip(chosen, ks):
                request.spec_token_ids = propose_ngram(request.token_ids, k)

    def _end_after_prompt(self, request: Request) -> RequestOutput:
        """End a request for no tokens (``max_tokens`` 0) once its prompt is computed: finish
        reason length, with its prompt logprobs. ``_settle`` releases its blocks."""
        request.finish_reason = FinishReason.LENGTH
        request.timings.finished = time.perf_counter()
        delta = CompletionOutput(0, "", [], [] if request.logprobs is not None else None, FinishReason.LENGTH)
        return self._output(request, delta, True, request.prompt_logprobs)

    def _emit(self, request: Request, sampled: SampledTokens) -> list[RequestOutput]:
        """Append sampled tokens one by one until the request finishes."""
        # K/V now holds every real token and each accepted proposal.
        request.num_computed_tokens = request.num_tokens + len(sampled.token_ids) - 1
        now = time.perf_counter()
        outputs = []
        for row in range(len(sampled.token_ids)):
            outputs.append(self._append_token(request, sampled, row, now))
            if request.finish_reason is not None:
                break
        if request.prediction is not None and outputs:
            self._count_prediction(request.prediction, outputs)
        return outputs

    def _count_prediction(self, prediction: Prediction, outputs: list[RequestOutput]) -> None:
        """Mark the step's tokens that came from the request's prediction (one each), and the
        proposed ones verification rejected (on the step's first delta)."""
        accepted, rejected = prediction.take_step(len(outputs))
        self.prediction_totals[0] += accepted
        self.prediction_totals[1] += rejected
        for output in outputs[:accepted]:
            output.outputs[0].accepted_prediction_tokens = 1
        outputs[0].outputs[0].rejected_prediction_tokens = rejected

    def _append_token(self, request: Request, sampled: SampledTokens, row: int, now: float) -> RequestOutput:
        token_id = sampled.token_ids[row]
        params = request.params
        request.token_ids.append(token_id)
        request.timings.token_times.append(now)
        if request.timings.first_token is None:
            request.timings.first_token = now
        logprob = None
        if request.logprobs is not None:
            logprob = self._token_logprob(token_id, sampled, row)
            request.logprobs.append(logprob)
        detokenizer = self.detokenizers[request.request_id]
        is_eos = token_id in self.loaded.config.eos_token_ids and not params.ignore_eos
        if token_id in params.stop_token_set or is_eos:
            request.finish_reason = FinishReason.STOP
            request.stop_reason = token_id if token_id in params.stop_token_set else None
            if params.include_stop_str_in_output:  # the stop token's text too, as vLLM
                detokenizer.add_token(token_id, match_stop=False)
        else:
            # As eos and stop token ids, a stop string ends the output only after min_tokens tokens (as vLLM).
            stop = detokenizer.add_token(token_id, match_stop=request.num_output_tokens > params.min_tokens)
            if stop is not None:
                request.finish_reason, request.stop_reason = FinishReason.STOP, stop
            elif request.matcher is not None and advance(request.matcher, token_id):
                request.finish_reason = FinishReason.STOP  # the grammar is complete
            elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
                request.finish_reason = FinishReason.LENGTH
        finished = request.finish_reason is not None
        if finished:
            request.timings.finished = now
        delta = CompletionOutput(0, detokenizer.take_new_text(final=finished), [token_id],
                                 [logprob] if logprob is not None else None, request.finish_reason, request.stop_reason)
        first = request.num_output_tokens == 1
        return self._output(request, delta, finished, request.prompt_logprobs if first else None)

    def _token_logprob(self, token_id: int, sampled: SampledTokens, row: int, rank: int | None = None
                       ) -> TokenLogprob:
        decode = self.tokenizer.decode
        top = [(i, decode([i]), lp) for i, lp in zip(sampled.top_ids[row], sampled.top_logprobs[row])]
        return TokenLogprob(token_id, decode([token_id]), sampled.logprobs[row], top, rank)

    def _release(self, request: Request) -> None:
        self.scheduler.finish(request)
        if self.draft is not None:
            self.draft.release(request.request_id)
        del self.requests[request.request_id]
        del self.detokenizers[request.request_id]

    def _output(self, request: Request, delta: CompletionOutput, finished: bool,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestOutput:
        return RequestOutput(request.request_id, request.prompt_token_ids, [delta], finished,
                             request.num_cached_tokens, request.timings, prompt_logprobs=prompt_logprobs)

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, kv.usage,
                           self.scheduler.num_preemptions, kv.num_free_blocks, len(kv.blocks),
                           kv.stats.prefix_queries, kv.stats.prefix_hits, self.spec_stats.num_steps,
                           self.spec_stats.num_proposed, self.spec_stats.num_accepted, *self.prediction_totals)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        live = {r.request_id for r in self.scheduler.running} | {e[1].request_id for e in self.scheduler.waiting}
        assert live == set(self.requests), "scheduler and engine disagree on live requests"
        assert set(self.kv.tables) <= {r.request_id for r in self.scheduler.running}, "a waiting request holds blocks"
        if self.draft is not None:
            self.draft.check_integrity(live)
