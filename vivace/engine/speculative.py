"""Speculative decoding: propose k tokens cheaply, verify them in one target forward.

The n-gram proposer looks the last n tokens up earlier in the request (prompt and
output) and proposes what followed. Verification keeps the target's distribution
exactly: at temperature 0 a proposal survives only if it is the target's argmax; above
it, a proposal x drawn from a draft distribution q is accepted with probability
min(1, p(x) / q(x)), and on rejection the token comes from the residual max(0, p - q)
renormalized. A proposal without a distribution (n-gram, a prediction: a point mass) survives
only if the target's own draw, made from the request's generator as a step without proposals
makes it, is that token: the same tokens in the same order, so a seeded request's output does
not depend on whether (or how far) it speculated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


def propose_ngram(token_ids: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix (``max_n`` down to ``min_n`` tokens) of ``token_ids``; [] when none recurs.

    The search runs over the ids as 4-byte words with ``bytes.rfind`` (C speed): this runs on the
    engine's thread for every speculating request every step, and a Python scan of a long context
    (tens of milliseconds at 32k tokens) would cost more than the step it speeds up."""
    length = len(token_ids)
    words = np.asarray(token_ids, dtype=np.int32).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = words[4 * (length - n):]
        end = 4 * (length - 1)  # a match ends before the last token
        while (found := words.rfind(suffix, 0, end)) >= 0:
            if found % 4 == 0:
                start = found // 4
                return token_ids[start + n:start + n + k]
            end = found + len(suffix) - 1  # straddles two words: look further back
    return []


@dataclass
class SpecStats:
    num_steps: int = 0          # verification forwards that carried proposals
    num_proposed: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted proposals plus the target's own)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0


class ProposalState(Protocol):
    """What ``AdaptiveK`` keeps per proposer of a request (``Request``, ``Prediction``)."""

    spec_k: int       # adaptive proposal length (0: not yet set)
    spec_misses: int  # consecutive steps with nothing accepted
    spec_pause: int   # steps left without speculation


class AdaptiveK:
    """Per-request proposal length, and a pause in speculation for ``pause_steps`` steps after
    ``max_misses`` steps in a row where nothing was accepted (then it resumes, at the length it
    had).

    With ``shrink`` (proposals that cost a forward each: a draft model; a prediction's, which
    cost rows) the length grows by one (or is multiplied by ``grow``, when that is more than 1)
    while proposals land, halves on a miss and drops to what was accepted on a partial hit.
    Without it (n-gram) the length stays ``max_k``: proposing is free, and a rejected token
    costs only one more row of a verify step, which reads the weights once whatever its rows.
    """

    def __init__(self, max_k: int, shrink: bool = True, pause_steps: int = 16, max_misses: int = 3,
                 grow: int = 1) -> None:
        self.max_k = max_k
        self.shrink = shrink
        self.grow = grow
        self.pause_steps = pause_steps
        self.max_misses = max_misses

    def next_k(self, request: ProposalState) -> int:
        if request.spec_pause > 0:
            request.spec_pause -= 1
            return 0
        return request.spec_k or self.max_k

    def update(self, request: ProposalState, proposed: int, accepted: int) -> None:
        if accepted:
            request.spec_misses = 0
        else:
            request.spec_misses += 1
            if request.spec_misses >= self.max_misses:
                request.spec_pause, request.spec_misses = self.pause_steps, 0
        if not self.shrink:
            return
        k = request.spec_k or self.max_k
        if accepted == proposed:
            request.spec_k = min(k * self.grow if self.grow > 1 else k + 1, self.max_k)
        else:
            request.spec_k = max(accepted, 1) if accepted else max(k // 2, 1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the distribution ``probs`` (1-D, non-negative, any positive sum): the first
    whose cumulative probability passes a uniform draw (one double from ``generator``) times the
    sum. A token of probability 0 is never drawn. ``torch.multinomial`` draws the same
    distribution but took ~1.5 ms over a 49,152-token vocabulary on a CPU (the default model's
    whole decode step is ~8 ms); this takes ~0.08 ms."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= len(cdf):  # u rounded up to the sum: the last token that has any probability
        index = int(torch.nonzero(probs).max())
    return index


def verify(probs_or_logits: torch.Tensor, proposal: list[int], greedy: bool,
           generator: torch.Generator, draft_probs: torch.Tensor | None = None) -> list[int]:
    """Tokens to emit for one request: the accepted prefix of ``proposal`` then one token of
    the target's own (a correction or, when all are accepted, a bonus).

    ``probs_or_logits`` has ``len(proposal) + 1`` rows: argmax-ready logits when ``greedy``,
    else the target's sampling probabilities. ``draft_probs`` (one row per proposal) is the
    draft's distribution; None means each proposal was certain (n-gram).
    """
    if greedy:
        targets = probs_or_logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == targets[accepted]:
            accepted += 1
        return proposal[:accepted] + [targets[accepted]]
    probs = probs_or_logits
    if draft_probs is None:
        emitted = []
        for j, row in enumerate(probs):
            emitted.append(draw(row, generator))
            if j == len(proposal) or emitted[j] != proposal[j]:
                return emitted
    for j, token in enumerate(proposal):
        if torch.rand((), generator=generator).item() * float(draft_probs[j, token]) < float(probs[j, token]):
            continue
        residual = (probs[j] - draft_probs[j]).clamp_min(0.0)
        return proposal[:j] + [draw(residual, generator)]
    return proposal + [draw(probs[-1], generator)]
