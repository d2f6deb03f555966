"""How many prompt tokens a step may carry while streams are decoding, and which way they run:
as many as fit the inter-token latency target, by a cost model of the steps learned as the
engine runs.

A prompt chunk can run two ways beside the decode rows of a step. As *rows* of the compiled
decode step (one row per prompt token): nearly free at the start of a prompt, but each row
reads its sequence's whole KV so far, so a chunk deep into a long prompt costs a KV read per
token. Or on the *prefill* path: the step runs eagerly (the decode rows through the decode
attention op, the chunk through the paged prefill attention, which reads the prompt's KV once
per chunk), which costs a fixed overhead per step but little per deep token.

A step carrying ``d`` decode tokens and ``p`` prompt tokens at positions summing to ``1000 * k``
lasts about ``base + per_decode * d`` plus, as rows, ``per_row * p + per_row_kpos * k`` (a
coefficient of ``k`` for runs of fewer than :data:`LONG_RUN_ROWS` rows of one sequence, which the
decode kernel attends row by row, and another for longer runs, which take the prefill kernel),
or, on the prefill path, ``prefill_base + per_prefill_token * p + per_prefill_kpos * k`` seconds.
:class:`StepCostModel` fits those eight numbers to the measured steps (least squares, recent
steps weighted more, pulled toward a prior while data is thin); every step teaches it, the
prompt-only ones (prefill path, ``d = 0``) too. :func:`plan_prompt` is the whole policy: the
prompt gets the time between the decode-only step and the ITL target, on whichever path fits
more tokens in it (rows: no more than the compiled step takes), and never fewer than
:func:`min_prompt_tokens` (4, or 16 deep into a prompt; on the path where they cost less) nor
more than twice the step before's (a new prompt's chunks ramp up); a prompt overdue on its TTFT
target gets twice the room; with nothing decoding, the whole step budget goes to prompts.

On a device whose prompt chunks always run the eager step (``fill_eager``: the CUDA runner, whose
graphs replay decodes alone), there is no rows path, and that step's fixed cost (eagerly ~18 ms
of host launches for an 8B model on an H200, where a decode step is ~6 ms and a prompt token
~0.01 ms; less where the step replays a prompt-step graph)
breaks the target whatever chunk it carries. With the cold chunk (16 tokens) a 512-token prompt
beside 16 streams took 32 such steps, ~0.75 s, one prompt after another; with the floor (4) it
would take 128. So when the room holds less than the floor and the floor would run eagerly, or
the model is cold, the step is filled: it takes the prompt tokens that cost up to
:data:`FILL_FACTOR` times its fixed cost, so that the overhead is at most half of what a prompt
costs the streams, and a prompt is done in a few steps. The prompt steps alone teach it (the
decode steps the overlapped engine queues ahead teach the decode-only terms: without them the model
never warmed on the GPU). Until :data:`WARM_STEPS` prompt steps were seen, the fill
doubles each step from the cold chunk (:func:`eager_fill`). Under the default target (a rule of
thumb, twice the decode step) a step on that path carries no fewer tokens than the fill even where
the room holds more than the floor: beside 11 streams served on an H200 the room held ~5 tokens, so
each such step paid the path's whole fixed cost for 5, and 64 streams' prompts were admitted one per
~100 ms (1,170 tokens/s, TTFT p50 5.8 s; ``benchmarks/served_sim.py`` reproduces it on a CPU). An
explicit ``--itl-target-ms`` is kept. And where the runner replays prompt steps from graphs of a few
token counts (``token_buckets``), each costing its bucket's replay whatever it carries below it, a
prefill-path step's tokens are rounded up to fill its bucket. Without ``fill_eager`` (the CPU), the
plans are as above.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vivace.config import EngineConfig

logger = logging.getLogger(__name__)

# The chunk a step takes, as rows, until the model has seen enough steps to be trusted.
COLD_PROMPT_TOKENS = 16
# The least a waiting prompt gets while decodes run, on whichever path it costs less: without it,
# deep into a long prompt the room under the default target fits a few tokens on either path,
# and a 4,096-token prompt beside 8 streams waited 16 x its idle TTFT (docs/benchmarks.md). 4,
# not 16, since chunk rows are attended once (16 rows cost ~20 ms over a 15 ms decode step, so
# the floor itself broke the target with few streams; measured in docs/benchmarks.md, issue 14).
MIN_PROMPT_TOKENS = 4
# The floor from this many tokens into a prompt on: deep rows attended a few at a time cost twice
# what 16 cost each, as runs of 16 rows or more take the prefill kernel, which reads the sequence's
# K/V once for all of them (8 streams beside rows at 3,000 tokens: 4 rows +20.6 ms, 8 rows +39.1,
# 16 rows +41.5; at 1,000 tokens 4 rows +7.6, 16 rows +23.7, docs/benchmarks.md issue 14). With a
# floor of 4 throughout, a 4,096-token prompt beside 8 streams waited 4.7 x its idle TTFT.
DEEP_PROMPT_START = 2048
DEEP_MIN_PROMPT_TOKENS = 16
# Runs of this many rows of one sequence or more, in the compiled step, are attended by the
# prefill kernel, which reads the sequence's K/V once for all of them (decode_attention.cpp's
# MIN_PREFILL_RUN); shorter runs row by row. Their depth costs differ, so the model fits each apart:
# with one coefficient, the deep 16-row chunks of a long prompt pulled the fit of shallow rows.
LONG_RUN_ROWS = 16
# Without --itl-target-ms the target is this many times the predicted decode-only step.
DEFAULT_ITL_FACTOR = 2.0
# A prompt past its TTFT target gets this many times the ITL target's room.
OVERDUE_FACTOR = 2.0
# While decodes run, a step's prompt tokens are at most this many times the step before's (never
# below the floor), so a new prompt's chunks ramp up as the model sees what they cost where its
# fit is thin: with no cap, each 256-token arrival beside 8 streams opened with the compiled step's
# 56 free rows at once, ~60 ms steps where 40 ms were planned, the streams' p99 gaps.
GROWTH_FACTOR = 2
# With fill_eager: an eager step that breaks the target anyway takes the prompt tokens costing up to
# this many times its fixed cost (its decodes and the path's overhead), past the growth cap: the
# fixed cost is paid whatever the chunk, and the per-token cost was learned from every prompt step.
FILL_FACTOR = 1.0
# Steps of each kind (decode-only, with prompt) the cost model must have seen to be warm.
WARM_STEPS = 8
# Observations a warm model may bound a step's time with the fit of before, unsolved (a solve
# costs ~60 us; the bound is three times the prediction, which a few steps do not move).
RESOLVE_EVERY = 16
# With fill_eager, the steps with a prompt after which the fit caps a cold model's growing fill.
FILL_FIT_STEPS = 3


class PromptPath(Enum):
    """How a step's prompt tokens run beside its decode rows."""

    ROWS = "rows"  # as rows of the compiled decode step
    PREFILL = "prefill"  # the eager step: paged prefill attention for the chunk


def min_prompt_tokens(prompt_start: int) -> int:
    """The least a waiting prompt gets while decodes run, for a chunk starting at ``prompt_start``."""
    return DEEP_MIN_PROMPT_TOKENS if prompt_start >= DEEP_PROMPT_START else MIN_PROMPT_TOKENS


def prompt_kilopositions(start: int, tokens: int) -> float:
    """The positions of ``tokens`` prompt tokens from position ``start`` on, summed, in thousands."""
    return tokens * (start + (tokens - 1) / 2) / 1000


# Prior coefficients, seconds (per unit of each term): base, per decode token, per prompt row,
# per thousand prompt-row positions in short runs, the same in long runs, prefill-path overhead,
# per prefill token, per thousand prefill positions. Optimistic about the prefill path, so that a deep chunk tries it soon and
# the measured steps decide.
PRIOR = (0.002, 0.0005, 0.0005, 0.0002, 0.0001, 0.004, 0.0005, 0.00002)


def step_features(decode_tokens: int, prompt_tokens: int, prompt_kpos: float, path: PromptPath,
                  long_run_kpos: float | None = None, long_run_rows: int = LONG_RUN_ROWS) -> np.ndarray:
    """The cost model's terms of a step (see :data:`PRIOR` for their order). ``long_run_kpos``:
    the part of ``prompt_kpos`` in runs of ``long_run_rows`` rows or more, those the prefill kernel
    attends (None: the step's prompt tokens are one run)."""
    rows = path is PromptPath.ROWS
    prefill = 0.0 if rows else 1.0
    if long_run_kpos is None:
        long_run_kpos = prompt_kpos if prompt_tokens >= long_run_rows else 0.0
    return np.array([1.0, decode_tokens, prompt_tokens * rows, (prompt_kpos - long_run_kpos) * rows,
                     long_run_kpos * rows, prefill, prompt_tokens * prefill, prompt_kpos * prefill])


class StepCostModel:
    """Step seconds as a linear function of :func:`step_features`.

    Exponentially weighted least squares: each observation's weight halves every
    ``half_life`` later observations; a ridge of ``prior_weight`` observations' worth pulls the
    coefficients toward ``prior``. Once warm, a measured step longer than three times its
    prediction counts as three times (a neighbour's stall is not the step's cost; a real change
    of cost still moves the fit three-fold per step).
    """

    def __init__(self, prior: tuple[float, ...] = PRIOR, prior_weight: float = 1.0, half_life: float = 200.0,
                 long_run_rows: int = LONG_RUN_ROWS) -> None:
        # Prompt runs of this many rows or more, as rows of the compiled step, take the prefill
        # kernel (1: every run, the runner's batch_invariant).
        self.long_run_rows = long_run_rows
        self.prior = np.array(prior, dtype=np.float64)
        self.ridge = prior_weight * np.eye(len(prior))
        self.decay = 0.5 ** (1.0 / half_life)
        self.gram = np.zeros((len(prior), len(prior)))
        self.moment = np.zeros(len(prior))
        self._coefficients = self.prior.copy()
        self._unsolved = 0  # observations since the coefficients were last solved for
        self.num_decode_only = 0
        self.num_with_prompt = 0

    @property
    def coefficients(self) -> np.ndarray:
        """The fit of every observation so far, solved when read (a solve is ~60 us, and a
        decode-only step at batch 1 observes one and reads none)."""
        if self._unsolved:
            self._solve()
        return self._coefficients

    def _solve(self) -> None:
        self._coefficients = np.linalg.solve(self.gram + self.ridge, self.moment + self.ridge @ self.prior)
        self._unsolved = 0

    @property
    def warm(self) -> bool:
        """Whether the fit rests on enough steps of both kinds to be trusted over the prior."""
        return self.num_decode_only >= WARM_STEPS and self.num_with_prompt >= WARM_STEPS

    def observe(self, decode_tokens: int, prompt_tokens: int, prompt_kpos: float, seconds: float,
                path: PromptPath = PromptPath.ROWS, long_run_kpos: float | None = None) -> None:
        """Adds one measured step (``prompt_kpos``: its prompt tokens' positions summed, in
        thousands; ``long_run_kpos``: as in :func:`step_features`)."""
        x = step_features(decode_tokens, prompt_tokens, prompt_kpos, path, long_run_kpos, self.long_run_rows)
        if self.warm:  # against the fit of at most RESOLVE_EVERY observations ago: a 3x bound
            if self._unsolved >= RESOLVE_EVERY:
                self._solve()
            seconds = min(seconds, 3.0 * max(float(self._coefficients @ x), 0.0))
        self.gram = self.decay * self.gram + np.outer(x, x)
        self.moment = self.decay * self.moment + seconds * x
        self._unsolved += 1
        if prompt_tokens:
            self.num_with_prompt += 1
        else:
            self.num_decode_only += 1

    def predict(self, decode_tokens: int, prompt_tokens: int = 0, prompt_kpos: float = 0.0,
                path: PromptPath = PromptPath.ROWS) -> float:
        """Predicted seconds of a step (its prompt tokens one run), never below zero."""
        x = step_features(decode_tokens, prompt_tokens, prompt_kpos, path, long_run_rows=self.long_run_rows)
        return max(float(self.coefficients @ x), 0.0)

    def prompt_tokens_within(self, seconds: float, start: int, path: PromptPath = PromptPath.ROWS) -> int:
        """The most prompt tokens, from position ``start`` on, that add at most ``seconds`` to a
        step on ``path`` (the prefill path's overhead included; as rows, one run)."""
        c = self.coefficients
        if path is PromptPath.PREFILL:
            return self._tokens_within(seconds - max(float(c[5]), 0.0), start, c[6], c[7])
        short = min(self._tokens_within(seconds, start, c[2], c[3]), self.long_run_rows - 1)
        long = self._tokens_within(seconds, start, c[2], c[4])
        return max(short, long) if long >= self.long_run_rows else short

    def eager_fill_tokens(self, decode_tokens: int, start: int) -> int:
        """The most prompt tokens, from position ``start`` on, whose own cost on the prefill path is
        at most :data:`FILL_FACTOR` times the fixed cost of that path's step beside
        ``decode_tokens`` decodes."""
        fixed = self.predict(decode_tokens, path=PromptPath.PREFILL)
        return self._tokens_within(FILL_FACTOR * fixed, start, self.coefficients[6], self.coefficients[7])

    @staticmethod
    def _tokens_within(seconds: float, start: int, per_token: float, per_kpos: float) -> int:
        """The most tokens from ``start`` on at ``per_token`` seconds each plus ``per_kpos`` per
        thousand positions that fit in ``seconds``."""
        per_token, per_kpos = max(float(per_token), 1e-6), max(float(per_kpos), 0.0)
        if seconds <= 0:
            return 0
        # seconds >= per_token * p + per_kpos * p * (start + (p - 1) / 2) / 1000: a quadratic in p,
        # whose root is written so that a tiny per_kpos does not cancel it away (a -> 0: seconds / b).
        a, b = per_kpos / 2000, per_token + per_kpos * (start - 0.5) / 1000
        return math.floor(2 * seconds / (b + math.sqrt(b * b + 4 * a * seconds)))


@dataclass(frozen=True)
class PacerTargets:
    """``itl`` seconds between a stream's tokens (None: ``DEFAULT_ITL_FACTOR`` times the decode
    step); ``ttft`` seconds a prompt may wait for its first token before it is overdue (None: never)."""

    itl: float | None = None
    ttft: float | None = None


@dataclass(frozen=True)
class PromptPlan:
    """A step's prompt tokens (at most) and the path they take."""

    tokens: int
    path: PromptPath


def plan_prompt(model: StepCostModel, targets: PacerTargets, decode_tokens: int, step_budget: int,
                oldest_prompt_wait: float, compiled_rows: int = 0, prompt_start: int = 0,
                last_prompt_tokens: int | None = None, fill_eager: bool = False,
                token_buckets: Sequence[int] = ()) -> PromptPlan:
    """The prompt tokens for a step that carries ``decode_tokens`` decode tokens and has
    ``step_budget`` tokens left, and their path, when the longest-waiting unserved prompt has
    waited ``oldest_prompt_wait`` seconds, the compiled step takes up to ``compiled_rows`` rows
    (0: no compiled step, so no rows path), the next prompt chunk starts at ``prompt_start`` and
    the step before carried ``last_prompt_tokens`` prompt tokens (None: no growth cap);
    ``fill_eager``: an eager step that breaks the target anyway is filled, and a step on the prefill
    path carries no fewer prompt tokens than that fill (the module's doc); ``token_buckets``: the
    token counts of the prefill path's graphs, each step paying for the smallest that holds it, so
    that a prefill-path step's tokens are rounded up to fill its bucket.
    Tokens are always within ``[min(min_prompt_tokens(prompt_start), step_budget), step_budget]``:
    however tight the target, a waiting prompt moves."""
    plan = _plan_prompt(model, targets, decode_tokens, step_budget, oldest_prompt_wait, compiled_rows, prompt_start,
                        last_prompt_tokens, fill_eager)
    if plan.path is PromptPath.PREFILL and decode_tokens and token_buckets:
        bucket = next((b for b in token_buckets if b >= decode_tokens + plan.tokens), None)
        if bucket is not None:
            return PromptPlan(min(bucket - decode_tokens, step_budget), plan.path)
    return plan


def _plan_prompt(model: StepCostModel, targets: PacerTargets, decode_tokens: int, step_budget: int,
                 oldest_prompt_wait: float, compiled_rows: int, prompt_start: int, last_prompt_tokens: int | None,
                 fill_eager: bool) -> PromptPlan:
    """:func:`plan_prompt` before the rounding to a bucket."""
    rows_path = PromptPath.ROWS if compiled_rows else PromptPath.PREFILL
    if decode_tokens == 0:
        return PromptPlan(step_budget, PromptPath.PREFILL)
    fill = eager_fill(model, decode_tokens, prompt_start) if fill_eager else 0
    if not model.warm:
        tokens = max(COLD_PROMPT_TOKENS, fill) if rows_path is PromptPath.PREFILL else COLD_PROMPT_TOKENS
        return PromptPlan(min(tokens, step_budget), rows_path)
    decode_step = model.predict(decode_tokens)
    target = targets.itl if targets.itl is not None else DEFAULT_ITL_FACTOR * decode_step
    room = target - decode_step
    if targets.ttft is not None and oldest_prompt_wait > targets.ttft:
        room *= OVERDUE_FACTOR
    prefill = model.prompt_tokens_within(room, prompt_start, PromptPath.PREFILL)
    rows = min(model.prompt_tokens_within(room, prompt_start), compiled_rows - decode_tokens) if compiled_rows else 0
    floor = min_prompt_tokens(prompt_start)
    if last_prompt_tokens is not None:
        cap = max(floor, GROWTH_FACTOR * last_prompt_tokens)
        rows, prefill = min(rows, cap), min(prefill, cap)
    if max(rows, prefill) < floor:  # the floor, on the path where it costs less
        tokens = min(floor, step_budget)
        kpos = prompt_kilopositions(prompt_start, tokens)
        cheaper_as_rows = (compiled_rows and decode_tokens + tokens <= compiled_rows and model.predict(
            decode_tokens, tokens, kpos) <= model.predict(decode_tokens, tokens, kpos, PromptPath.PREFILL))
        if cheaper_as_rows:
            return PromptPlan(tokens, PromptPath.ROWS)
        return PromptPlan(min(max(tokens, fill), step_budget), PromptPath.PREFILL)
    if rows >= prefill:
        return PromptPlan(min(rows, step_budget), PromptPath.ROWS)
    if targets.itl is None:  # the default target, a rule of thumb, does not make an eager step's fixed cost a waste
        prefill = max(prefill, fill)
    return PromptPlan(min(prefill, step_budget), PromptPath.PREFILL)


def eager_fill(model: StepCostModel, decode_tokens: int, prompt_start: int) -> int:
    """The prompt tokens that fill an eager step beside ``decode_tokens`` decodes, for a chunk from
    ``prompt_start`` on: :meth:`StepCostModel.eager_fill_tokens`. While the model has seen ``n <``
    :data:`WARM_STEPS` steps with a prompt, at most ``COLD_PROMPT_TOKENS * GROWTH_FACTOR ** n`` (and
    that alone for ``n <`` :data:`FILL_FIT_STEPS`), so that chunks of growing sizes teach it the
    step's fixed cost apart from its tokens': chunks all of one size cannot, and the fit they left
    once filled 19 tokens where 500 fitted."""
    seen = model.num_with_prompt
    if seen >= WARM_STEPS:
        return model.eager_fill_tokens(decode_tokens, prompt_start)
    ramp = COLD_PROMPT_TOKENS * GROWTH_FACTOR ** seen
    return ramp if seen < FILL_FIT_STEPS else min(ramp, model.eager_fill_tokens(decode_tokens, prompt_start))


class Pacer:
    """The scheduler's pacer: plans each step's prompt tokens and learns from each step.
    ``compiled_rows``: the most rows the engine's compiled step takes, prompt rows among them (0:
    none); ``fill_eager``: as in :func:`plan_prompt`."""

    def __init__(self, targets: PacerTargets, compiled_rows: int = 0, model: StepCostModel | None = None,
                 fill_eager: bool = False, token_buckets: Sequence[int] = ()) -> None:
        self.targets = targets
        self.compiled_rows = compiled_rows
        self.fill_eager = fill_eager
        self.token_buckets = tuple(token_buckets)
        self.model = model or StepCostModel()
        self.last_prompt_tokens = 0  # of the step observed last

    def plan(self, decode_tokens: int, step_budget: int, oldest_prompt_wait: float, prompt_start: int) -> PromptPlan:
        """:func:`plan_prompt` with this pacer's model and targets; logs its inputs at debug."""
        plan = plan_prompt(self.model, self.targets, decode_tokens, step_budget, oldest_prompt_wait,
                           self.compiled_rows, prompt_start, self.last_prompt_tokens, self.fill_eager,
                           self.token_buckets)
        if logger.isEnabledFor(logging.DEBUG):
            terms = " ".join(f"{c * 1e3:.4f}" for c in self.model.coefficients)
            logger.debug("pacer: decode_tokens=%d step_budget=%d oldest_prompt_wait=%.3fs prompt_start=%d "
                         "compiled_rows=%d last_prompt_tokens=%d fill_eager=%s targets=%s model_ms=(%s) warm=%s "
                         "-> %d prompt tokens as %s", decode_tokens, step_budget, oldest_prompt_wait, prompt_start,
                         self.compiled_rows, self.last_prompt_tokens, self.fill_eager, self.targets, terms,
                         self.model.warm, plan.tokens, plan.path.value)
        return plan

    def observe(self, decode_tokens: int, prompt_tokens: int, prompt_kpos: float, seconds: float,
                path: PromptPath, long_run_kpos: float | None = None) -> None:
        """Feeds one measured step, run on ``path``, to the cost model (``long_run_kpos``: as in
        :func:`step_features`)."""
        self.model.observe(decode_tokens, prompt_tokens, prompt_kpos, seconds, path, long_run_kpos)
        self.last_prompt_tokens = prompt_tokens


def pacer_for(config: EngineConfig, compiled_rows: int, fill_eager: bool = False,
              token_buckets: Sequence[int] = (), long_run_rows: int = LONG_RUN_ROWS) -> Pacer | None:
    """The pacer ``config`` asks for (None when it fixes the prefill chunk), for an engine whose
    compiled step takes up to ``compiled_rows`` rows, prompt rows among them (0: none), runs of
    ``long_run_rows`` or more through the prefill kernel, and which fills an eager step that
    breaks the target anyway when ``fill_eager`` (:func:`plan_prompt`)."""
    if config.max_prefill_chunk is not None:
        return None
    itl, ttft = config.itl_target_ms, config.ttft_target_ms
    return Pacer(PacerTargets(None if itl is None else itl / 1e3, None if ttft is None else ttft / 1e3),
                 compiled_rows, StepCostModel(long_run_rows=long_run_rows), fill_eager=fill_eager,
                 token_buckets=token_buckets)
