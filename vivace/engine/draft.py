"""A draft model that proposes tokens for the target: its own weights, its own KV blocks.

Each target request has a shadow sequence on the draft side. Before proposing, the shadow
is synced to the target's tokens: whatever the draft computed past the first token where
they differ (rejected proposals) is recomputed, the rest of its cache is kept.
"""

from __future__ import annotations

import torch

from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.request import Request
from vivace.engine.runner import ModelRunner
from vivace.engine.sampler import Sampler
from vivace.engine.sampling_params import SamplingParams
from vivace.engine.scheduler import ScheduledBatch
from vivace.engine.speculative import draw
from vivace.models import LoadedModel


def common_prefix(a: list[int], b: list[int], hint: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, knowing it is at most ``hint``."""
    n = min(hint, len(a), len(b))
    while n > 0 and a[n - 1] != b[n - 1]:
        n -= 1
    return n


class DraftProposer:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                 target_vocab_size: int) -> None:
        if loaded.config.vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({loaded.config.vocab_size}) differs from the "
                             f"target's ({target_vocab_size}); a draft must share the target's tokenizer")
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(loaded, num_blocks, block_size, dtype)
        self.shadows: dict[str, Request] = {}

    def _sync(self, request: Request) -> Request:
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, list(request.token_ids), request.params)
            self.shadows[request.request_id] = shadow
            return shadow
        # At least the last token is recomputed: proposing needs its logits, which were not kept.
        known = common_prefix(shadow.token_ids, request.token_ids, shadow.num_computed_tokens)
        shadow.num_computed_tokens = min(known, len(request.token_ids) - 1)
        shadow.token_ids = list(request.token_ids)
        return shadow

    def propose(self, requests: list[Request], ks: list[int], sampler: Sampler) -> None:
        """Set ``spec_token_ids`` (and ``spec_draft_probs`` when sampling) of each request,
        running the draft once per proposed position over all of them."""
        shadows = [self._sync(r) for r in requests]
        proposals: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for step in range(max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if step < k]
            batch = ScheduledBatch()
            for i in active:
                num_new = shadows[i].num_tokens - shadows[i].num_computed_tokens
                if not self.kv.allocate_slots(shadows[i], num_new):
                    ks[i] = step  # the draft pool is full: propose what we have
                    continue
                batch.requests.append(shadows[i])
                batch.num_new_tokens.append(num_new)
            if not batch:
                break
            ends = torch.tensor(batch.num_new_tokens).cumsum(0) - 1
            logits = self.runner.execute(batch, self.kv, ends.tolist())
            for row, shadow in enumerate(batch.requests):
                i = shadows.index(shadow)
                token, dist = self._draw(logits[row], requests[i].params, requests[i], sampler)
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.token_ids.append(token)
                proposals[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
        for request, proposal, dists in zip(requests, proposals, probs):
            request.spec_token_ids = proposal
            request.spec_draft_probs = torch.stack(dists) if dists else None

    @staticmethod
    def _draw(logits: torch.Tensor, params: SamplingParams, request: Request,
              sampler: Sampler) -> tuple[int, torch.Tensor | None]:
        if params.greedy:
            return int(logits.argmax()), None
        dist = sampler.probabilities(logits.float(), params)
        return draw(dist, request.generator or sampler.generator), dist

    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def check_integrity(self, live: set[str]) -> None:
        self.kv.check_integrity()
        assert set(self.shadows) <= live, "a draft shadow outlived its request"
