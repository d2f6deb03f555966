"""Offline batch generation: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence

from vivace.config import EngineConfig
from vivace.engine.async_engine import choice_params
from vivace.engine.llm_engine import LLMEngine
from vivace.engine.outputs import CompletionOutput, RequestOutput
from vivace.engine.sampling_params import SamplingParams


def _accumulate(total: CompletionOutput, delta: CompletionOutput) -> None:
    total.text += delta.text
    total.token_ids.extend(delta.token_ids)
    if delta.logprobs is not None:
        total.logprobs = (total.logprobs or []) + delta.logprobs
    total.finish_reason, total.stop_reason = delta.finish_reason, delta.stop_reason
    total.accepted_prediction_tokens += delta.accepted_prediction_tokens
    total.rejected_prediction_tokens += delta.rejected_prediction_tokens


class LLM:
    """Runs many prompts at once with continuous batching; returns whole outputs."""

    def __init__(self, model: str = "default", **config: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        results: dict[str, RequestOutput] = {}
        order: list[list[str]] = []
        for prompt, request_params in zip(prompts, all_params):
            ids = []
            for index in range(request_params.n):
                request_id = uuid.uuid4().hex
                request = self.engine.add_request(request_id, prompt, choice_params(request_params, index))
                results[request_id] = RequestOutput(
                    request_id, request.prompt_token_ids,
                    [CompletionOutput(index, "", [], [] if request.logprobs is not None else None, None)],
                    False, 0, request.timings)
                ids.append(request_id)
            order.append(ids)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                total = results[delta.request_id]
                _accumulate(total.outputs[0], delta.outputs[0])
                total.prompt_logprobs = delta.prompt_logprobs or total.prompt_logprobs
                total.finished, total.num_cached_tokens = delta.finished, delta.num_cached_tokens
                total.error = delta.error
        return [self._merge([results[i] for i in ids]) for ids in order]

    @staticmethod
    def _merge(choices: list[RequestOutput]) -> RequestOutput:
        first = choices[0]
        error = next((c.error for c in choices if c.error is not None), None)
        return dataclasses.replace(first, outputs=[c.outputs[0] for c in choices], error=error)

    def check_integrity(self) -> None:
        self.engine.check_integrity()
