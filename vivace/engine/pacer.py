"""How many prompt tokens a step may carry while streams are decoding: as many as fit the
inter-token latency target, by a cost model of the steps learned as the engine runs.

A step that carries ``d`` decode tokens and ``p`` prompt tokens at positions summing to
``1000 * k`` lasts about ``base + per_decode_token * d + per_prompt_token * p + per_prompt_kiloposition * k``
seconds: the last term is the prompt rows' attention, which grows with how far into its prompt a
chunk is. :class:`StepCostModel` fits those four numbers to the measured steps (least squares,
recent steps weighted more, pulled toward a prior while data is thin). :func:`prompt_budget` is
the whole policy: the prompt gets the time between the decode-only step and the ITL target; with
compiled decode graphs, no more rows than the compiled step takes (a prompt chunk rides it almost
for free; one row more turns the whole step eager, about twice as slow); a prompt overdue on its
TTFT target gets twice the room and may leave the compiled step; with nothing decoding, the whole
step budget goes to prompts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vivace.config import EngineConfig

logger = logging.getLogger(__name__)

# The fixed chunk used until the model has seen enough steps; also the least a prompt ever gets
# while decodes run, so that no target, however tight, starves waiting prompts.
MIN_PROMPT_TOKENS = 16
# Without --itl-target-ms the target is this many times the predicted decode-only step.
DEFAULT_ITL_FACTOR = 2.0
# A prompt past its TTFT target gets this many times the ITL target's room.
OVERDUE_FACTOR = 2.0


def prompt_kilopositions(start: int, tokens: int) -> float:
    """The positions of ``tokens`` prompt tokens from position ``start`` on, summed, in thousands."""
    return tokens * (start + (tokens - 1) / 2) / 1000


class StepCostModel:
    """Step seconds as ``base + per_decode_token * d + per_prompt_token * p + per_prompt_kiloposition * k``.

    Exponentially weighted least squares: each observation's weight halves every
    ``half_life`` later observations; a ridge of ``prior_weight`` observations' worth pulls the
    coefficients toward ``prior`` (seconds, then seconds per unit of each term). Once warm, a
    measured step longer than three times its prediction counts as three times (a neighbour's
    stall is not the step's cost; a real change of cost still moves the fit three-fold per step).
    """

    def __init__(self, prior: tuple[float, float, float, float] = (0.002, 0.0005, 0.0005, 0.0),
                 prior_weight: float = 1.0, half_life: float = 200.0) -> None:
        self.prior = np.array(prior, dtype=np.float64)
        self.ridge = prior_weight * np.eye(len(prior))
        self.decay = 0.5 ** (1.0 / half_life)
        self.gram = np.zeros((len(prior), len(prior)))
        self.moment = np.zeros(len(prior))
        self.coefficients = self.prior.copy()
        self.num_decode_only = 0
        self.num_with_prompt = 0

    @property
    def warm(self) -> bool:
        """Whether the fit rests on enough steps of both kinds to be trusted over the prior."""
        return self.num_decode_only >= 8 and self.num_with_prompt >= 8

    def observe(self, decode_tokens: int, prompt_tokens: int, prompt_kpos: float, seconds: float) -> None:
        """Adds one measured step (``prompt_kpos``: its prompt tokens' positions summed, in thousands)."""
        if self.warm:
            seconds = min(seconds, 3.0 * self.predict(decode_tokens, prompt_tokens, prompt_kpos))
        x = np.array([1.0, decode_tokens, prompt_tokens, prompt_kpos])
        self.gram = self.decay * self.gram + np.outer(x, x)
        self.moment = self.decay * self.moment + seconds * x
        self.coefficients = np.linalg.solve(self.gram + self.ridge, self.moment + self.ridge @ self.prior)
        if prompt_tokens:
            self.num_with_prompt += 1
        else:
            self.num_decode_only += 1

    def predict(self, decode_tokens: int, prompt_tokens: int = 0, prompt_kpos: float = 0.0) -> float:
        """Predicted seconds of a step, never below zero."""
        x = np.array([1.0, decode_tokens, prompt_tokens, prompt_kpos])
        return max(float(self.coefficients @ x), 0.0)

    def prompt_tokens_within(self, seconds: float, start: int) -> int:
        """The most prompt tokens, from position ``start`` on, that add at most ``seconds``."""
        per_token = max(float(self.coefficients[2]), 1e-6)
        per_kpos = max(float(self.coefficients[3]), 0.0)
        # seconds >= per_token * p + per_kpos * p * (start + (p - 1) / 2) / 1000: a quadratic in p.
        a, b = per_kpos / 2000, per_token + per_kpos * (start - 0.5) / 1000
        tokens = seconds / b if a == 0 else (math.sqrt(b * b + 4 * a * seconds) - b) / (2 * a)
        return math.floor(tokens) if seconds > 0 else 0


@dataclass(frozen=True)
class PacerTargets:
    """``itl`` seconds between a stream's tokens (None: ``DEFAULT_ITL_FACTOR`` times the decode
    step); ``ttft`` seconds a prompt may wait for its first token before it is overdue (None: never)."""

    itl: float | None = None
    ttft: float | None = None


def prompt_budget(model: StepCostModel, targets: PacerTargets, decode_tokens: int, step_budget: int,
                  oldest_prompt_wait: float, compiled_rows: int = 0, prompt_start: int = 0) -> int:
    """Prompt tokens for a step that carries ``decode_tokens`` decode tokens and has
    ``step_budget`` tokens left, when the longest-waiting unserved prompt has waited
    ``oldest_prompt_wait`` seconds, the compiled step takes up to ``compiled_rows`` rows (0: no
    compiled step) and the next prompt chunk starts at position ``prompt_start``.
    Always within ``[min(MIN_PROMPT_TOKENS, step_budget), step_budget]``."""
    if decode_tokens == 0:
        return step_budget
    if not model.warm:
        return min(MIN_PROMPT_TOKENS, step_budget)
    decode_step = model.predict(decode_tokens)
    target = targets.itl if targets.itl is not None else DEFAULT_ITL_FACTOR * decode_step
    room = target - decode_step
    overdue = targets.ttft is not None and oldest_prompt_wait > targets.ttft
    if overdue:
        room *= OVERDUE_FACTOR
    tokens = model.prompt_tokens_within(room, prompt_start)
    if compiled_rows and not overdue:
        tokens = min(tokens, compiled_rows - decode_tokens)
    return min(max(tokens, MIN_PROMPT_TOKENS), step_budget)


class Pacer:
    """The scheduler's pacer: chooses each step's prompt budget and learns from each step.
    ``compiled_rows``: the most rows the engine's compiled step takes (0: none)."""

    def __init__(self, targets: PacerTargets, compiled_rows: int = 0, model: StepCostModel | None = None) -> None:
        self.targets = targets
        self.compiled_rows = compiled_rows
        self.model = model or StepCostModel()

    def budget(self, decode_tokens: int, step_budget: int, oldest_prompt_wait: float, prompt_start: int) -> int:
        """:func:`prompt_budget` with this pacer's model and targets; logs its inputs at debug."""
        tokens = prompt_budget(self.model, self.targets, decode_tokens, step_budget, oldest_prompt_wait,
                               self.compiled_rows, prompt_start)
        if logger.isEnabledFor(logging.DEBUG):
            base, per_decode, per_prompt, per_kpos = self.model.coefficients
            logger.debug("pacer: decode_tokens=%d step_budget=%d oldest_prompt_wait=%.3fs prompt_start=%d "
                         "compiled_rows=%d model=(%.2fms + %.3fms/decode + %.4fms/prompt + %.4fms/kpos, "
                         "warm=%s) -> %d prompt tokens", decode_tokens, step_budget, oldest_prompt_wait,
                         prompt_start, self.compiled_rows, base * 1e3, per_decode * 1e3, per_prompt * 1e3,
                         per_kpos * 1e3, self.model.warm, tokens)
        return tokens

    def observe(self, decode_tokens: int, prompt_tokens: int, prompt_kpos: float, seconds: float) -> None:
        """Feeds one measured step to the cost model, if it is of the kind the model describes:
        one that decodes (prompt-only steps run the prefill path), within the compiled rows."""
        rows = decode_tokens + prompt_tokens
        if decode_tokens and (not self.compiled_rows or rows <= self.compiled_rows):
            self.model.observe(decode_tokens, prompt_tokens, prompt_kpos, seconds)


def pacer_for(config: EngineConfig, compiled_rows: int) -> Pacer | None:
    """The pacer ``config`` asks for (None when it fixes the prefill chunk), for an engine whose
    compiled step takes up to ``compiled_rows`` rows (0: none)."""
    if config.max_prefill_chunk is not None:
        return None
    itl, ttft = config.itl_target_ms, config.ttft_target_ms
    return Pacer(PacerTargets(None if itl is None else itl / 1e3, None if ttft is None else ttft / 1e3),
                 compiled_rows)
