"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

GrammarKind = Literal["json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class ThinkBlock:
    """A think block, between the tokens ``open_id`` and ``close_id``, that a grammar leaves free
    before the output it constrains. ``opened``: the prompt opened it, so the output starts inside
    it (a repeated opening token first is allowed); else the output may open one first, or not."""

    open_id: int
    close_id: int
    opened: bool


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. ``spec`` is text: a JSON schema (``json_schema``),
    a regular expression (``regex``), a JSON list of strings (``choice``), or a Lark or GBNF
    grammar in llguidance's dialect (``grammar``). With ``alternative``, the output matches
    either this or that (an agent's tool calls or its answer in a schema); with
    ``after_thinking``, it constrains only what follows that think block (the alternative's own
    ``after_thinking`` is not read). ``vivace.engine.grammar`` compiles it."""

    kind: GrammarKind
    spec: str
    after_thinking: ThinkBlock | None = None
    alternative: StructuredOutput | None = None

# Temperatures below this sample greedily: dividing logits by less overflows float32 (as vLLM).
SAMPLING_EPS = 1e-5
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_LOGPROBS = 20  # top alternatives a request may ask for, per generated or prompt token (OpenAI's)
LOGIT_BIAS_RANGE = 100.0  # a bias lies in [-100, 100] (OpenAI's range)


class ParamError(ValueError):
    """A request the engine can't take; ``param`` names the request field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """What to sample and when to stop. Validated on construction (raises ParamError, a ValueError).

    ``temperature < SAMPLING_EPS`` (0 included) means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``logprobs`` is None (none) or the number of top alternatives to return
    besides the chosen token's logprob (0 = only the chosen token); ``prompt_logprobs`` the same
    for each prompt token after the first, under the raw model (vLLM's). ``max_tokens`` 0 computes
    the prompt and ends (finish reason length). ``logit_bias`` maps token ids to what is added to
    their logits before anything else (an empty map is None).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # allow speculative decoding for this request (when the engine has it)
    structured: StructuredOutput | None = None  # constrain the output (such requests never speculate)
    logit_bias: dict[int, float] | None = None
    # The output's expected tokens (OpenAI's predicted outputs): proposals come from them, even on
    # an engine without speculation; the output stays what it would be without (vivace.engine.prediction).
    prediction: list[int] | None = None
    # Prefix-cache hits come only from requests with the same salt (vivace.engine.kv_cache).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))  # each id once, whatever was sent
        try:  # token ids as ints, whatever the caller keyed them by ("50256", as JSON has them)
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} if self.logit_bias else None
        except (TypeError, ValueError):
            raise ParamError("logit_bias maps token ids to numbers", "logit_bias") from None
        bias = self.logit_bias or {}
        checks = [
            (self.n >= 1, "n", "n must be >= 1"),
            (self.temperature >= 0, "temperature", "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "top_k must be -1, 0 (disabled) or positive"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens", "max_tokens must be >= 0"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            (len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens"),
            (all(t >= 0 for t in bias), "logit_bias", "logit_bias token ids must be >= 0"),
            (all(-LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE for b in bias.values()), "logit_bias",
             f"logit_bias values must be in [{-LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise ParamError(message, param)

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: checking a token costs the same for thousands as for one."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

