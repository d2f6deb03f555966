"""Turn a batch of logits into next tokens, one row per request with its own parameters.

Order: logit bias, penalties, min_tokens masking, then (for non-greedy rows) temperature,
top-k, top-p and min-p, then a draw from the request's own generator, so a seeded request
samples the same tokens whatever else shares its batch. Logprobs are those of the
model's distribution after bias and penalties, before temperature and truncation; prompt
logprobs (``score_tokens``) those of the raw model, from the same float32 log-softmax.

Safe for every value the request schema accepts: overflow (a tiny repetition penalty or
temperature) saturates at the largest finite float instead of becoming inf, every filter keeps
the most likely token, and logprobs leave as finite numbers (MIN_LOGPROB for -inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vivace.engine.request import Request
from vivace.engine.sampling_params import SamplingParams
from vivace.engine.speculative import draw, verify

# What a logprob of -inf is written as (as vLLM does): JSON has no infinities.
MIN_LOGPROB = -9999.0


@dataclass
class SampledTokens:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen token, per row (None if no row asked)
    top_ids: list[list[int]]      # per row, the top-N alternatives (empty if not asked)
    top_logprobs: list[list[float]]

    def row(self, i: int) -> SampledTokens:
        """The one-row result of row ``i``."""
        return SampledTokens([self.token_ids[i]], None if self.logprobs is None else [self.logprobs[i]],
                             [self.top_ids[i]], [self.top_logprobs[i]])


@dataclass
class DeviceSamples:
    """Tokens a runner drew on its device (``vivace.gpu.sampler``), as the host sampler returns
    them, and per row whether its logits were all finite."""

    tokens: SampledTokens
    finite: list[bool]


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Float32 log-softmax over the whole vocabulary, MIN_LOGPROB for -inf and NaN: the numbers
    every logprob the engine returns is read from."""
    return torch.nan_to_num_(logits.float().log_softmax(-1), nan=MIN_LOGPROB, neginf=MIN_LOGPROB)


# Prompt rows scored at a time: each batch of rows costs a log-softmax copy of [rows, vocab].
SCORE_ROWS = 64


def score_tokens(logits: torch.Tensor, token_ids: list[int], num_top: int) -> tuple[SampledTokens, list[int]]:
    """The logprob of ``token_ids[i]`` under row i of ``logits`` as the model gives it (no bias,
    penalty or mask: prompt logprobs), its rank (1: the most likely), and the row's ``num_top``
    most likely tokens; rows are scored a few at a time, keeping only these numbers."""
    chosen: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    for start in range(0, len(token_ids), SCORE_ROWS):
        logprobs = log_probs(logits[start:start + SCORE_ROWS])
        ids = torch.tensor(token_ids[start:start + SCORE_ROWS]).unsqueeze(1)
        own = logprobs.gather(1, ids)
        chosen += own.squeeze(1).tolist()
        ranks += ((logprobs > own).sum(-1) + 1).tolist()
        values, indices = logprobs.topk(num_top, dim=-1)
        top_ids += indices.tolist()
        top_logprobs += values.tolist()
    return SampledTokens(list(token_ids), chosen, top_ids, top_logprobs), ranks


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    """Add each request's ``logit_bias`` to its row (as vLLM, before the penalties)."""
    for row, request in enumerate(requests):
        bias = request.params.logit_bias
        if bias:
            logits[row, list(bias)] += torch.tensor(list(bias.values()), dtype=logits.dtype)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition (on prompt and output tokens), presence and frequency (on output) penalties."""
    for row, request in enumerate(requests):
        params = request.params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.long)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / params.repetition_penalty,
                                            values * params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            output = request.output_token_ids
            if output:
                ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
                logits[row, ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty


def saturate(logits: torch.Tensor) -> torch.Tensor:
    """In place: +inf becomes the largest finite value, NaN becomes -inf (-inf stays), so the
    argmax survives and a softmax over a row with any finite value stays finite."""
    return torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max,
                             neginf=float("-inf"))


def before_min_tokens(request: Request) -> bool:
    """Whether ``request`` has fewer output tokens than its min_tokens (its stop tokens banned)."""
    return request.num_output_tokens < request.params.min_tokens


def mask_stop_tokens(logits: torch.Tensor, requests: list[Request], eos_token_ids: tuple[int, ...]) -> None:
    """Forbid eos and stop tokens until a request has its min_tokens (their ids gathered once per request)."""
    for row, request in enumerate(requests):
        if before_min_tokens(request):
            if request.min_tokens_banned is None:
                params = request.params
                eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
                request.min_tokens_banned = torch.tensor(sorted(params.stop_token_set | eos), dtype=torch.long)
            logits[row].index_fill_(0, request.min_tokens_banned, float("-inf"))


# How many of a row's largest values a filter first looks at, and the factor that grows by when
# they are not enough. A model's distribution is usually peaked (a top_p of 0.9 at temperature 1
# keeps tens of tokens), and topk of 64 over 128k values costs ~0.1 ms where sorting the row
# costs ~10 ms.
NUCLEUS_FIRST, NUCLEUS_GROWTH = 64, 8


class Largest:
    """The largest values of one row, descending, with their ids: a prefix found by topk (or
    given: a batch's topk), grown when a filter asks for more; past an eighth of the row, the
    whole row sorted."""

    def __init__(self, row: torch.Tensor, values: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                 log_total: torch.Tensor | None = None) -> None:
        self.row, self.values, self.ids, self._log_total = row, values, ids, log_total

    def first(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = self.row.shape[-1]
        if self.values is None or len(self.values) < min(n, vocab):
            k = vocab if n * NUCLEUS_GROWTH > vocab else n
            self.values, self.ids = self.row.topk(k)
        return self.values[:n], self.ids[:n]

    def count_at_least(self, floor: torch.Tensor, limit: int) -> int:
        """How many of the first ``limit`` values are ``floor`` or more."""
        n = NUCLEUS_FIRST
        while True:
            values, _ = self.first(min(n, limit))
            if len(values) == limit or values[-1] < floor:
                return int((values >= floor).sum())
            n *= NUCLEUS_GROWTH

    def log_total(self) -> torch.Tensor:
        if self._log_total is None:
            self._log_total = torch.logsumexp(self.row, -1)
        return self._log_total


def kept_tokens(logits: torch.Tensor, top_k: int, top_p: float, min_p: float,
                largest: Largest | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ids (ascending) and values of the tokens the top-k / min-p / top-p filters keep in
    ``logits`` (one row; ``largest`` its :class:`Largest` if the caller has one); None when they
    keep every token. Each filter keeps the row's values down to a cut, ties at the cut too, as
    ``vivace.gpu.sampler.filter_scores`` does for a batch, and looks only as far down the row as
    its cut: no filter sorts the row or writes a row-sized mask (``masked_fill`` costs ~3 ns a
    token on a CPU, ~0.8 ms at 262,144) unless it keeps most of it."""
    vocab = logits.shape[-1]
    largest = largest or Largest(logits)
    count = top_k if 0 < top_k < vocab else vocab  # kept: the first `count` largest values
    if min_p > 0:
        floor = largest.first(1)[0][0] + math.log(min_p)  # p / p_max >= min_p, in logits
        count = largest.count_at_least(floor, count)
    if top_p < 1.0:
        log_total = largest.log_total() if count == vocab else torch.logsumexp(largest.first(count)[0], -1)
        n = NUCLEUS_FIRST
        while True:
            values, _ = largest.first(min(n, count))
            probs = (values - log_total).exp()
            inside = max(int(((probs.cumsum(-1) - probs) < top_p).sum()), 1)
            if inside < len(values) or len(values) == count:
                count = inside
                break
            n *= NUCLEUS_GROWTH
    if count == vocab:
        return None
    values, ids = largest.first(count + 1)
    if values[count] == values[count - 1]:  # a tie at the cut: every token equal to it stays
        ids = torch.nonzero(logits >= values[count - 1]).flatten()
    else:
        ids = ids[:count]
    ids = ids.sort().values
    return ids, logits[ids]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """``logits`` (one row) with the tokens outside the top-k / min-p / top-p filters at -inf."""
    kept = kept_tokens(logits, top_k, top_p, min_p)
    if kept is None:
        return logits
    ids, values = kept
    return torch.full_like(logits, float("-inf")).index_copy_(0, ids, values)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampledTokens:
        """``logits`` (one row per request) are left as they are: a copy is changed where bias,
        penalties or min_tokens call for it."""
        biased = any(r.params.logit_bias for r in requests)
        penalized = any(r.params.has_penalties for r in requests)
        masked = any(before_min_tokens(r) for r in requests)
        source, logits = logits, logits.float()
        if (biased or penalized or masked) and logits is source:
            logits = logits.clone()
        if biased:
            apply_logit_bias(logits, requests)
        if penalized:
            apply_penalties(logits, requests)
        if biased or penalized:  # the only sources of inf here
            saturate(logits)
        mask_stop_tokens(logits, requests, self.eos_token_ids)
        # The argmax only where a row is greedy (~50 us over a 49,152-token row on a CPU).
        token_ids = logits.argmax(-1).tolist() if any(r.params.greedy for r in requests) else [0] * len(requests)
        drawn = [row for row, request in enumerate(requests) if not request.params.greedy]
        if drawn:
            for row, token_id in zip(drawn, self._draw_rows(logits, [requests[row] for row in drawn], drawn)):
                token_ids[row] = token_id
        return self._with_logprobs(logits, requests, token_ids)

    def verify(self, logits: torch.Tensor, request: Request, proposal: list[int]) -> SampledTokens:
        """Verify a proposal from the target's ``len(proposal) + 1`` logits rows; one row of the
        result per emitted token. Callers propose only for requests without penalties or
        pending min_tokens, whose rows need no processing beyond logit bias, temperature and
        truncation."""
        logits = logits.float()
        params = request.params
        if params.logit_bias:
            logits = logits.clone()
            apply_logit_bias(logits, [request] * len(logits))
            saturate(logits)
        if params.greedy:
            scores = logits
        else:
            scores = torch.stack([self.probabilities(row, params) for row in logits])
        emitted = verify(scores, proposal, params.greedy, request.generator or self.generator,
                         request.spec_draft_probs)
        rows = logits[:len(emitted)]
        return self._with_logprobs(rows, [request] * len(emitted), emitted)

    @staticmethod
    def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The distribution a non-greedy request samples from (temperature, then truncation)."""
        scaled = saturate(logits / params.temperature)
        kept = kept_tokens(scaled, params.top_k, params.top_p, params.min_p)
        if kept is None:
            return scaled.softmax(-1)
        ids, values = kept
        return torch.zeros_like(scaled).index_copy_(0, ids, values.softmax(-1))

    def _draw_rows(self, logits: torch.Tensor, requests: list[Request], rows: list[int]) -> list[int]:
        """A token from each of ``rows`` by :meth:`probabilities`, drawn among the kept tokens only
        (in vocabulary order: the token a whole row's draw gives for the same uniform number).
        What costs a pass over the vocabulary is done for the rows at once: temperature, the
        largest values the filters look at first, the normalizer."""
        vocab = logits.shape[-1]
        params = [request.params for request in requests]
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        scaled = saturate(logits[rows] / temperature)
        first = max(min(p.top_k + 1, vocab) if 0 < p.top_k < vocab else NUCLEUS_FIRST if p.top_p < 1.0 or p.min_p > 0
                    else 0 for p in params)
        values, ids = scaled.topk(min(first, vocab)) if first else (None, None)
        log_totals = torch.logsumexp(scaled, -1) if any(p.top_p < 1.0 and p.top_k <= 0 for p in params) else None
        tokens = []
        for i, (request, p) in enumerate(zip(requests, params)):
            largest = Largest(scaled[i], None if values is None else values[i], None if ids is None else ids[i],
                              None if log_totals is None else log_totals[i])
            kept = kept_tokens(scaled[i], p.top_k, p.top_p, p.min_p, largest)
            generator = request.generator or self.generator
            if kept is None:
                tokens.append(draw(scaled[i].softmax(-1), generator))
            else:
                tokens.append(int(kept[0][draw(kept[1].softmax(-1), generator)]))
        return tokens

    def _with_logprobs(self, logits: torch.Tensor, requests: list[Request], token_ids: list[int]) -> SampledTokens:
        wanted = [r.params.logprobs for r in requests]
        if all(n is None for n in wanted):
            return SampledTokens(token_ids, None, [[] for _ in requests], [[] for _ in requests])
        logprobs = log_probs(logits)
        chosen = logprobs.gather(1, torch.tensor(token_ids).unsqueeze(1)).squeeze(1).tolist()
        max_n = max(n or 0 for n in wanted)
        top_values, top_ids = logprobs.topk(max_n, dim=-1) if max_n else (None, None)
        top_id_rows, top_lp_rows = [], []
        for row, n in enumerate(wanted):
            n = n or 0
            top_id_rows.append(top_ids[row, :n].tolist() if n else [])
            top_lp_rows.append(top_values[row, :n].tolist() if n else [])
        return SampledTokens(token_ids, chosen, top_id_rows, top_lp_rows)
