"""The synchronous engine core: add requests, step, read outputs. Not thread-safe;
``AsyncEngine`` drives it from one thread."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from vivace.config import EngineConfig
from vivace.engine.detokenizer import IncrementalDetokenizer
from vivace.engine.draft import DraftProposer
from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from vivace.engine.request import Request
from vivace.engine.runner import ModelRunner, num_blocks_for_budget
from vivace.engine.sampler import SampledTokens, Sampler
from vivace.engine.sampling_params import SamplingParams
from vivace.engine.scheduler import Scheduler
from vivace.engine.speculative import AdaptiveK, SpecStats, propose_ngram
from vivace.layers.packed_linear import prepack_linears
from vivace.models import LoadedModel, load_model


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


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded or load_model(config.model, config.torch_dtype, config.quantization)
        prepack_linears(self.loaded.model)
        self.tokenizer = self.loaded.tokenizer
        model_len = self.loaded.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            self.loaded, config.block_size, config.torch_dtype, config.kv_cache_memory_gb, self.max_model_len)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_chunk)
        self.runner = ModelRunner(self.loaded, num_blocks, config.block_size, config.torch_dtype,
                                  self.max_model_len, config.max_num_seqs if config.compile else 0)
        self.sampler = Sampler(self.loaded.config.eos_token_ids, config.seed)
        self.spec_stats = SpecStats()
        # n-gram proposals cost nothing to make; a draft's cost a forward per token.
        self.adaptive_k = AdaptiveK(config.num_speculative_tokens, shrink=config.speculative != "ngram")
        self.draft: DraftProposer | None = None
        if config.speculative and config.speculative.startswith("draft:"):
            draft_model = load_model(config.speculative.removeprefix("draft:"), config.torch_dtype,
                                     config.quantization)
            prepack_linears(draft_model.model)
            self.draft = DraftProposer(draft_model, num_blocks, config.block_size, config.torch_dtype,
                                       self.loaded.config.vocab_size)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()

    @property
    def model_name(self) -> str:
        return self.loaded.name

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when the request can never be served."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        wanted = num_prompt + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt} prompt tokens plus {params.max_tokens or 1} max_tokens were requested")
        if -(-wanted // self.kv.block_size) > len(self.kv.blocks):
            raise ValueError(f"the request needs {wanted} tokens of KV cache; the pool holds "
                             f"{len(self.kv.blocks) * self.kv.block_size}")

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
        self.requests[request_id] = request
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, token_ids, params.stop, params.skip_special_tokens,
            params.include_stop_str_in_output)
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now, freeing its blocks; None if it is unknown or already done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.finish_reason = FinishReason.ABORT
        request.timings.finished = time.perf_counter()
        self._release(request)
        delta = CompletionOutput(0, "", [], [] if request.logprobs is not None else None, FinishReason.ABORT)
        return self._output(request, delta, finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch; return a delta output for every token emitted (several for a request
        whose proposals were accepted, so clients still see one token per chunk)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.perf_counter()
        plan: list[tuple[Request, int, int]] = []  # request, first logits row, number of rows
        logit_indices: list[int] = []
        offset = 0
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            if request.timings.scheduled is None:
                request.timings.scheduled = now
            offset += num_new
            num_spec = len(request.spec_token_ids)
            if request.num_computed_tokens + num_new == request.num_tokens + num_spec:
                plan.append((request, len(logit_indices), num_spec + 1))
                logit_indices.extend(range(offset - 1 - num_spec, offset))
        logits = self.runner.execute(batch, self.kv, logit_indices)
        sampling = {request.request_id for request, _, _ in plan}
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            if request.request_id not in sampling:
                request.num_computed_tokens += num_new  # a prompt chunk that samples nothing yet
        outputs: list[RequestOutput] = []
        for request, sampled in self._sample(plan, logits):
            outputs.extend(self._emit(request, sampled))
        for request in batch.requests:
            self.kv.cache_full_blocks(request)
            if request.finish_reason is not None:
                self._release(request)
            else:
                self.kv.trim(request, request.num_tokens)
        self._propose()
        return outputs

    def _sample(self, plan: list[tuple[Request, int, int]], logits: torch.Tensor | None
                ) -> list[tuple[Request, SampledTokens]]:
        """Sample plain rows together; verify each request's proposals on its own rows."""
        plain = [(request, row) for request, row, num_rows in plan if num_rows == 1]
        results = []
        if plain:
            sampled = self.sampler(logits[[row for _, row in plain]], [r for r, _ in plain])
            results = [(request, sampled.row(i)) for i, (request, _) in enumerate(plain)]
        for request, row, num_rows in plan:
            if num_rows > 1:
                proposal = request.spec_token_ids
                sampled = self.sampler.verify(logits[row:row + num_rows], request, proposal)
                self._record_speculation(request, len(proposal), len(sampled.token_ids) - 1)
                request.spec_token_ids, request.spec_draft_probs = [], None
                results.append((request, sampled))
        return results

    def _record_speculation(self, request: Request, proposed: int, accepted: int) -> None:
        self.spec_stats.num_steps += 1
        self.spec_stats.num_proposed += proposed
        self.spec_stats.num_accepted += accepted
        self.adaptive_k.update(request, proposed, accepted)

    def _propose(self) -> None:
        """Queue proposals for the next step (n-gram or draft), when few requests are decoding."""
        if self.config.speculative is None:
            return
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        if len(decoding) > self.config.speculative_max_batch:
            return
        chosen, ks = [], []
        for request in decoding:
            params = request.params
            if not params.speculative or params.has_penalties or request.num_output_tokens < params.min_tokens:
                continue
            room = min(params.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
            k = min(self.adaptive_k.next_k(request), room)
            if k > 0:
                chosen.append(request)
                ks.append(k)
        if self.draft is not None:
            self.draft.propose(chosen, ks, self.sampler)
        else:
            for request, k in zip(chosen, ks):
                request.spec_token_ids = propose_ngram(request.token_ids, k)

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
        return outputs

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
        if token_id in params.stop_token_ids or is_eos:
            request.finish_reason = FinishReason.STOP
            request.stop_reason = token_id if token_id in params.stop_token_ids else None
        else:
            stop = detokenizer.add_token(token_id, match_stop=request.num_output_tokens >= params.min_tokens)
            if stop is not None:
                request.finish_reason, request.stop_reason = FinishReason.STOP, stop
            elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
                request.finish_reason = FinishReason.LENGTH
        finished = request.finish_reason is not None
        if finished:
            request.timings.finished = now
        delta = CompletionOutput(0, detokenizer.take_new_text(final=finished), [token_id],
                                 [logprob] if logprob is not None else None, request.finish_reason, request.stop_reason)
        return self._output(request, delta, finished)

    def _token_logprob(self, token_id: int, sampled: SampledTokens, row: int) -> TokenLogprob:
        decode = self.tokenizer.decode
        top = [(i, decode([i]), lp) for i, lp in zip(sampled.top_ids[row], sampled.top_logprobs[row])]
        return TokenLogprob(token_id, decode([token_id]), sampled.logprobs[row], top)

    def _release(self, request: Request) -> None:
        self.scheduler.finish(request)
        if self.draft is not None:
            self.draft.release(request.request_id)
        del self.requests[request.request_id]
        del self.detokenizers[request.request_id]

    def _output(self, request: Request, delta: CompletionOutput, finished: bool) -> RequestOutput:
        return RequestOutput(request.request_id, request.prompt_token_ids, [delta], finished,
                             request.num_cached_tokens, request.timings)

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, kv.usage,
                           self.scheduler.num_preemptions, kv.num_free_blocks, len(kv.blocks),
                           kv.stats.prefix_queries, kv.stats.prefix_hits, self.spec_stats.num_steps,
                           self.spec_stats.num_proposed, self.spec_stats.num_accepted)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        live = {r.request_id for r in self.scheduler.running} | {e[1].request_id for e in self.scheduler.waiting}
        assert live == set(self.requests), "scheduler and engine disagree on live requests"
        assert set(self.kv.tables) <= {r.request_id for r in self.scheduler.running}, "a waiting request holds blocks"
        if self.draft is not None:
            self.draft.check_integrity(live)
