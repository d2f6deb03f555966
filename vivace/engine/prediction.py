"""Predicted outputs (OpenAI's ``prediction``): proposals read off text the answer is expected to
mostly repeat, such as a file being edited.

A request's prediction is kept aligned with its output: ``position`` is the index, in the
prediction's tokens, of the token expected next. After each step the output's last few tokens
are looked up in the prediction, first where the alignment says they should end, then at or
after it (an edit that deleted text), then before it (an edit that inserted text, after a
short match misled the alignment forward); the tokens that follow are the proposal. A
proposal is verified like any other (``vivace.engine.speculative.verify``), so the output is
exactly what it would have been without a prediction: only the number of forwards changes.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from vivace.engine.speculative import AdaptiveK

# Longest suffix of the output looked up in the prediction. Three tokens pin a place in code
# well; shorter ones are tried after it (one token: right after an edit, as in ``bar(`` for a
# renamed ``foo(``), only at or after the alignment, where a false match costs little.
MATCH_TOKENS = 3
# Longest proposal. An edit keeps long runs of the file identical, and a landing proposal of k
# tokens saves k forwards for one verify step of k + 1 rows, which reads the weights once; but
# its rows cost compute (the default model's compiled CPU step, served: 1 row 6.95 ms, 5 rows
# 10.6, 9 rows 15.9, 17 rows 25.5; docs/benchmarks.md, "Predicted outputs") and a miss wastes
# them, so the length doubles while proposals land and falls back on a miss (``AdaptiveK``).
# n-gram's default of 4 would cap a perfect prediction at 5 tokens a step. 14 keeps a verify step
# at 15 rows, below the run at which the decode attention op hands rows to the prefill kernel
# (MIN_PREFILL_RUN, 16, in vivace/layers/decode_attention.cpp): only the decode kernel computes a
# verify row exactly as the one-row step it stands for, which greedy exactness needs.
PREDICTION_MAX_K = 14


class Prediction:
    """One request's predicted output (token ids, no special tokens) and its alignment with the
    output so far, its adaptive proposal length (the ``spec_*`` fields ``AdaptiveK`` reads), and
    what verification did with its proposals."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = list(token_ids)
        self.position = 0       # index of the token expected next
        self.num_output = 0     # output tokens when ``position`` was last set
        self.spec_k = 0
        self.spec_misses = 0
        self.spec_pause = 0
        self.proposing = False  # the request's pending proposal came from here
        self.step_accepted = 0  # by the last verification, not yet counted (``take_step``)
        self.step_rejected = 0
        # Per token id, the positions that follow its occurrences, in order: one pass (a few
        # milliseconds for a 10,000-token file; this runs on the engine's thread).
        self._ends: dict[int, list[int]] = defaultdict(list)
        for end, token in enumerate(self.token_ids, 1):
            self._ends[token].append(end)

    def align(self, tail: list[int], num_output: int) -> int | None:
        """The index of the token expected after an output of ``num_output`` tokens that ends
        with ``tail`` (its last ``MATCH_TOKENS`` or fewer); None when it is not in the prediction."""
        if num_output == 0:
            return 0
        expected = self.position + num_output - self.num_output
        for n in range(min(MATCH_TOKENS, len(tail)), 0, -1):
            suffix = tail[-n:]
            if self._ends_with(expected, suffix):
                return expected
            ends = self._ends.get(suffix[-1], [])
            after = bisect.bisect_left(ends, self.position)
            found = next((end for end in ends[after:] if self._ends_with(end, suffix)), None)
            if found is None and n > 1:  # the latest match before the alignment
                found = next((end for end in reversed(ends[:after]) if self._ends_with(end, suffix)), None)
            if found is not None:
                return found
        return None

    def _ends_with(self, end: int, suffix: list[int]) -> bool:
        """Whether the prediction's tokens before position ``end`` are ``suffix``."""
        return len(suffix) <= end <= len(self.token_ids) and self.token_ids[end - len(suffix):end] == suffix

    def propose(self, tail: list[int], num_output: int, adaptive: AdaptiveK, room: int) -> list[int]:
        """The next tokens of the prediction after the output (at most ``room`` of them and the
        adaptive length), or [] when the output is not found in it or proposals are paused."""
        self.proposing = False
        position = self.align(tail, num_output)
        if position is None:
            return []
        self.position, self.num_output = position, num_output
        k = min(adaptive.next_k(self), room)
        proposal = self.token_ids[position:position + k] if k > 0 else []
        self.proposing = bool(proposal)
        return proposal

    def record(self, adaptive: AdaptiveK, proposed: int, accepted: int) -> None:
        """After verifying a proposal from here: hold its counts until its tokens are emitted
        (``take_step``), and adapt the length."""
        self.step_accepted, self.step_rejected = accepted, proposed - accepted
        self.proposing = False
        adaptive.update(self, proposed, accepted)

    def take_step(self, emitted: int) -> tuple[int, int]:
        """The last verification's (accepted, rejected) proposed tokens, once; accepted ones only
        among the ``emitted`` first tokens of its step (a stop may end the output before the rest)."""
        counts = min(self.step_accepted, emitted), self.step_rejected
        self.step_accepted = self.step_rejected = 0
        return counts


def prediction_adaptive_k() -> AdaptiveK:
    """The proposal length of predictions: up to ``PREDICTION_MAX_K``, doubling while proposals
    land, down to what landed on a partial hit (an edit starts there), halved on a miss."""
    return AdaptiveK(PREDICTION_MAX_K, shrink=True, grow=2)
