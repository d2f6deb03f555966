"""Sampling on the device: ``[rows, vocab]`` logits become next tokens (and their logprobs) without
leaving the GPU. Every parameter is a per-row device tensor filled before the step (``stage``), so
one captured CUDA graph per ``SamplerPlan`` serves any mix of requests; ``sample`` does no host
sync and allocates only shapes fixed by the rows and the vocabulary.

The host sampler's (``vivace.engine.sampler``) semantics, in its order: logit bias (up to
``MAX_LOGIT_BIAS`` tokens a row, from two small buffers), penalties (repetition on
prompt and output, presence and frequency on output) then saturation, the stop and eos tokens
banned until ``min_tokens``; greedy rows take the first argmax; sampled rows divide by their
temperature, keep top-k, then min-p, then the top-p nucleus (from one sort of the row: the three
keep a prefix of it, cut at one value, so ties at the cut are all kept), and draw. Logprobs are
``log_softmax`` of the logits after bias, penalties and bans, as the host returns them. Softmax sums run
in another order than on the host, so a token within float rounding of a min-p / top-p cut may fall
on the other side.

Draws are a Gumbel-max race: the argmax of the filtered, scaled logits plus ``-log(-log(u))``,
with ``u`` from Philox keyed by the request's seed and counted by its output position and the token
id. A seeded request so draws the same tokens alone, in any batch, and after a preemption; an
unseeded one draws from the engine's seed, a per-step counter and its row. The numbers differ from
the host sampler's draws (``vivace.engine.speculative.draw``; the distribution is the same; the
noise is capped at about 17.3, so a token more than that below the best in scaled logits,
probability < 4e-8, is never drawn).

The engine samples on the host instead (from logits, as on CPU) when a batch holds a request the
device cannot serve: a grammar-constrained one (its token masks are filled on the host), more
than ``MAX_BANNED`` stop and eos tokens to ban for ``min_tokens``, or more rows than the sampler
holds; speculative verification rows (rejection sampling over several rows) too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from vivace.engine.request import Request
from vivace.engine.sampler import MIN_LOGPROB, DeviceSamples, SampledTokens, saturate
from vivace.engine.sampling_params import MAX_LOGIT_BIAS
from vivace.gpu.kernels import INTERPRETED

MAX_BANNED = 16  # stop + eos tokens a row can ban until its min_tokens
MAX_TOP_LOGPROBS = 20  # the request schema's largest ``logprobs``
RACE_BLOCK = 1024  # tokens per iteration of the race kernel
RACE_SPLIT = 4096  # tokens per program of the race kernel (a row spans vocab / RACE_SPLIT programs)
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
# Columns of the float parameters.
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(6)
# Columns of the integer parameters; SEED, COUNTER and STREAM are adjacent (the race kernel reads them).
TOP_K, SEED, COUNTER, STREAM, PROMPT_LEN, HISTORY_LEN, BANNED = range(7)


@dataclass(frozen=True)
class SamplerPlan:
    """Which optional stages a batch needs; each combination is its own captured graph."""

    process: bool = False  # logit bias, penalties, or tokens banned until min_tokens
    filter: bool = False  # top-k / top-p / min-p on a sampled row
    logprobs: bool = False


ALL_PLANS = [SamplerPlan(*flags) for flags in itertools.product((False, True), repeat=3)]


def signed64(seed: int) -> int:
    """Any accepted seed as the int64 whose bits are its value modulo 2**64 (as ``Request`` maps it)."""
    seed %= 2**64
    return seed - 2**64 if seed >= 2**63 else seed


def workspace_bytes(rows: int, vocab_size: int, max_model_len: int) -> int:
    """An upper bound of the device memory ``DeviceSampler`` takes for ``rows`` rows: its history
    buffer, its logit-bias buffers and the transient tensors of its widest plan (a sort and a few
    row copies)."""
    return rows * (max_model_len * 4 + MAX_LOGIT_BIAS * 12 + vocab_size * 44)


class DeviceSampler:
    """Parameter buffers for up to ``max_rows`` rows, the staging of a batch's requests into them,
    and the sampling of logits from them."""

    def __init__(self, max_rows: int, vocab_size: int, max_model_len: int, eos_token_ids: tuple[int, ...],
                 seed: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self.device = device
        self.floats = torch.zeros(max_rows, FREQUENCY + 1, dtype=torch.float32, device=device)
        self.ints = torch.zeros(max_rows, BANNED + MAX_BANNED, dtype=torch.int64, device=device)
        self.history = torch.zeros(max_rows, max_model_len, dtype=torch.int32, device=device)
        # Each row's biased token ids and biases; unused entries add 0 to the column past the vocabulary.
        self.bias_ids = torch.full((max_rows, MAX_LOGIT_BIAS), vocab_size, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(max_rows, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.biased_rows = 0  # rows 0..biased_rows-1 may hold a bias from an earlier step
        self.num_steps = 0
        self.stage([None] * max_rows)

    def supports(self, requests: list[Request]) -> bool:
        """Whether ``sample`` can serve these requests (else the engine samples on the host)."""
        return len(requests) <= self.max_rows and all(
            r.matcher is None and len(self._banned(r)) <= MAX_BANNED for r in requests)

    def _banned(self, request: Request, ahead: int = 0) -> list[int]:
        """The tokens ``mask_stop_tokens`` forbids ``request`` this step (``ahead`` of its host
        state: drawing its output token ``num_output_tokens + ahead``)."""
        params = request.params
        if request.num_output_tokens + ahead >= params.min_tokens:
            return []
        return sorted(params.stop_token_set | (set() if params.ignore_eos else set(self.eos_token_ids)))

    def stage(self, rows: list[Request | None], ahead: int = 0) -> SamplerPlan:
        """Fill the parameters of rows ``0..len(rows)-1`` (None: a row nobody samples, drawn
        greedily) and return the plan they need. Queues host-to-device copies only. ``ahead``:
        the step draws each request's output token ``num_output_tokens + ahead`` (1 for a step
        launched before the previous one's tokens reached the host; not with penalties, whose
        history is the host's)."""
        n = len(rows)
        floats = np.zeros((n, self.floats.shape[1]), dtype=np.float32)
        floats[:, [TOP_P, REPETITION]] = 1.0
        ints = np.zeros((n, self.ints.shape[1]), dtype=np.int64)
        ints[:, BANNED:] = self.vocab_size  # a column past the vocabulary: bans nothing
        ints[:, SEED], ints[:, COUNTER], ints[:, STREAM] = signed64(self.seed), self.num_steps, np.arange(1, n + 1)
        self.num_steps += 1
        plan = SamplerPlan()
        penalized: list[int] = []
        for row, request in enumerate(rows):
            if request is not None:
                plan = self._stage_row(request, floats[row], ints[row], plan, ahead)
                if request.params.has_penalties:
                    penalized.append(row)
        if penalized:
            self._stage_history([rows[row] for row in penalized], penalized, ints)
        self._stage_bias(rows)
        self._upload(self.floats[:n], floats)
        self._upload(self.ints[:n], ints)
        return plan

    def _stage_row(self, request: Request, floats: np.ndarray, ints: np.ndarray, plan: SamplerPlan,
                   ahead: int) -> SamplerPlan:
        params = request.params
        filtered = False
        if not params.greedy:
            floats[[TEMPERATURE, TOP_P, MIN_P]] = params.temperature, params.top_p, params.min_p
            ints[TOP_K] = params.top_k
            filtered = 0 < params.top_k < self.vocab_size or params.top_p < 1.0 or params.min_p > 0
            if params.seed is not None:  # the request's own stream, counted by its output position
                ints[[SEED, COUNTER, STREAM]] = signed64(params.seed), request.num_output_tokens + ahead, 0
        floats[[REPETITION, PRESENCE, FREQUENCY]] = (params.repetition_penalty, params.presence_penalty,
                                                     params.frequency_penalty)
        banned = self._banned(request, ahead)
        ints[BANNED:BANNED + len(banned)] = banned
        process = params.has_penalties or bool(banned) or bool(params.logit_bias)
        return SamplerPlan(plan.process or process, plan.filter or filtered, plan.logprobs or params.logprobs is not None)

    def _stage_history(self, requests: list[Request], rows: list[int], ints: np.ndarray) -> None:
        """The token ids of the penalized rows (other rows' history lengths stay 0)."""
        width = max(r.num_tokens for r in requests)
        history = np.zeros((rows[-1] + 1, width), dtype=np.int32)
        for row, request in zip(rows, requests):
            history[row, :request.num_tokens] = request.token_ids
            ints[row, [PROMPT_LEN, HISTORY_LEN]] = request.num_prompt_tokens, request.num_tokens
        self._upload(self.history[:len(history), :width], history)

    def _stage_bias(self, rows: list[Request | None]) -> None:
        """The logit bias of rows ``0..len(rows)-1``. A batch without any costs nothing, unless a
        former one left biases in the buffer: those are zeroed once."""
        biases = [request.params.logit_bias if request is not None else None for request in rows]
        if not any(biases):
            if self.biased_rows:
                self.bias_values[:self.biased_rows].zero_()
                self.biased_rows = 0
            return
        n, width = len(rows), max(len(bias or ()) for bias in biases)
        ids = np.full((n, width), self.vocab_size, dtype=np.int64)
        values = np.zeros((n, width), dtype=np.float32)
        for row, bias in enumerate(biases):
            if bias:
                ids[row, :len(bias)], values[row, :len(bias)] = list(bias), list(bias.values())
        self.bias_values[:max(n, self.biased_rows)].zero_()
        self._upload(self.bias_ids[:n, :width], ids)
        self._upload(self.bias_values[:n, :width], values)
        self.biased_rows = n

    def _upload(self, buffer: torch.Tensor, array: np.ndarray) -> None:
        host = torch.from_numpy(array)
        buffer.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)

    def sample(self, logits: torch.Tensor, plan: SamplerPlan) -> torch.Tensor:
        """Draw from ``logits [rows, vocab]`` with the staged parameters of rows ``0..rows-1``:
        int32 ``[rows, 2]`` (token, logits all finite), plus, with ``plan.logprobs``, the chosen
        token's logprob, the top ids and their logprobs (floats as their bits; ``read`` unpacks).
        Capturable in a CUDA graph."""
        rows = logits.shape[0]
        floats, ints = self.floats[:rows], self.ints[:rows]
        finite = torch.isfinite(logits.sum(-1, keepdim=True))  # before any -inf of ours
        # The race reads any float dtype; the other stages work on a float32 copy, as the host does.
        scores = logits.float() if plan.process or plan.filter or plan.logprobs else logits
        if plan.process:
            scores = add_logit_bias(scores, self.bias_ids[:rows], self.bias_values[:rows])
            scores = penalize(scores, floats, ints, self.history[:rows])
        temperature = floats[:, TEMPERATURE]
        if plan.filter:
            scaled = saturate(scores / torch.where(temperature > 0, temperature, 1.0)[:, None])
            candidates = filter_scores(scaled, ints[:, TOP_K], floats[:, TOP_P], floats[:, MIN_P])
            tokens = race(candidates, temperature, ints[:, SEED:STREAM + 1], scale=False)
        else:
            tokens = race(scores, temperature, ints[:, SEED:STREAM + 1], scale=True)
        columns = [tokens.int(), finite.int()]
        if plan.logprobs:
            logprobs = torch.nan_to_num(scores.log_softmax(-1), nan=MIN_LOGPROB, neginf=MIN_LOGPROB)
            top_values, top_ids = logprobs.topk(min(MAX_TOP_LOGPROBS, scores.shape[1]), dim=-1)
            columns += [logprobs.gather(1, tokens).view(torch.int32), top_ids.int(), top_values.view(torch.int32)]
        return torch.cat(columns, 1)

    def read(self, packed: torch.Tensor, rows: list[int], requests: list[Request]) -> DeviceSamples:
        """The host's view of ``sample``'s output at ``rows`` (``requests[i]`` sampled row
        ``rows[i]``): one device-to-host copy (none if ``packed`` is on the host already)."""
        host = packed.cpu()[rows]
        tokens, finite = host[:, 0].tolist(), host[:, 1].bool().tolist()
        wanted = [r.params.logprobs or 0 for r in requests]
        if all(r.params.logprobs is None for r in requests):
            return DeviceSamples(SampledTokens(tokens, None, [[] for _ in rows], [[] for _ in rows]), finite)
        top = (host.shape[1] - 3) // 2
        chosen = host[:, 2].view(torch.float32).tolist()
        top_ids = [ids[:n] for ids, n in zip(host[:, 3:3 + top].tolist(), wanted)]
        top_values = [values[:n] for values, n in zip(host[:, 3 + top:].view(torch.float32).tolist(), wanted)]
        return DeviceSamples(SampledTokens(tokens, chosen, top_ids, top_values), finite)

    def run(self, logits: torch.Tensor, requests: list[Request]) -> DeviceSamples:
        """Stage, sample and read, eagerly: row i of ``logits`` belongs to ``requests[i]``."""
        packed = self.sample(logits, self.stage(list(requests)))
        return self.read(packed, list(range(len(requests))), requests)


def add_logit_bias(scores: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``apply_logit_bias`` of the host sampler, every row at once: ``values [rows, n]`` added at
    ``ids [rows, n]`` (an id equal to the vocabulary size adds to a spare column)."""
    rows, vocab = scores.shape
    bias = torch.zeros(rows, vocab + 1, device=scores.device).scatter_add_(1, ids, values)
    return scores + bias[:, :vocab]


def penalize(scores: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """``apply_penalties`` then ``saturate`` then ``mask_stop_tokens`` of the host sampler, every row
    at once: token counts come from the staged history by a scatter into one column past the
    vocabulary, where positions past a row's history (or, for counts, in its prompt) point."""
    rows, vocab = scores.shape
    position = torch.arange(history.shape[1], device=scores.device)
    ids = history.long().masked_fill(position >= ints[:, HISTORY_LEN, None], vocab)
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=scores.device).scatter_(1, ids, True)
    output_ids = ids.masked_fill(position < ints[:, PROMPT_LEN, None], vocab)
    counts = torch.zeros(rows, vocab + 1, device=scores.device).scatter_add_(
        1, output_ids, torch.ones(output_ids.shape, device=scores.device))[:, :vocab]
    repetition = floats[:, REPETITION, None]
    penalized = torch.where(scores > 0, scores / repetition, scores * repetition)
    scores = torch.where(seen[:, :vocab], penalized, scores)
    scores = torch.where(counts > 0, scores - (floats[:, FREQUENCY, None] * counts + floats[:, PRESENCE, None]), scores)
    saturate(scores)
    banned = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=scores.device).scatter_(1, ints[:, BANNED:], True)
    return scores.masked_fill(banned[:, :vocab], float("-inf"))


def filter_scores(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
                  ) -> torch.Tensor:
    """``filter_logits`` of every row at once (``top_k`` outside ``1..vocab-1``, ``top_p >= 1`` and
    ``min_p == 0`` disable theirs): the three filters keep a prefix of the row sorted by value, so
    they are applied in sorted order and the row is cut at the last value they keep."""
    vocab = scaled.shape[1]
    ranked = scaled.sort(-1, descending=True).values
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    ranked = ranked.masked_fill(ranked < ranked.gather(1, k[:, None] - 1), float("-inf"))
    probs = ranked.softmax(-1)
    ranked = ranked.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
    probs = ranked.softmax(-1)
    nucleus = torch.where(top_p < 1.0, top_p, float("inf"))
    keep = (probs.cumsum(-1) - probs < nucleus[:, None]) & (ranked > float("-inf"))
    keep[:, 0] = True  # the most likely token, always
    cut = ranked.gather(1, keep.sum(-1, keepdim=True) - 1)
    return scaled.masked_fill(scaled < cut, float("-inf"))


def race(scores: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, scale: bool,
         block: int | None = None, split: int | None = None) -> torch.Tensor:
    """Tokens ``[rows, 1]`` (int64): per row the first argmax of ``scores`` where ``temperature``
    is 0, else of ``scores / temperature`` (when ``scale``; saturated) plus Gumbel noise from
    Philox keyed by ``keys[:, 0]`` and counted by ``keys[:, 1]`` (64 bits), ``keys[:, 2]`` (stream)
    and the token id. One program per row and ``split`` tokens, ``block`` at a time (powers of two;
    by default ``RACE_SPLIT`` and ``RACE_BLOCK``, or the whole row under Triton's interpreter, where
    a program costs milliseconds whatever its size), then a torch argmax of the programs' winners."""
    rows, vocab = scores.shape
    assert scores.stride(1) == 1 and keys.dtype == torch.int64 and temperature.dtype == torch.float32
    whole_row = triton.next_power_of_2(vocab)
    block = min(block or (whole_row if INTERPRETED else RACE_BLOCK), whole_row)
    split = max(block, min(split or (whole_row if INTERPRETED else RACE_SPLIT), whole_row))
    num_splits = triton.cdiv(vocab, split)
    best = torch.empty(rows, num_splits, dtype=torch.float32, device=scores.device)
    token = torch.empty(rows, num_splits, dtype=torch.int32, device=scores.device)
    _race_kernel[(rows, num_splits)](scores, scores.stride(0), temperature, temperature.stride(0), keys,
                                     keys.stride(0), best, token, vocab, SCALE=scale, SPLIT=split, BLOCK=block)
    return token.gather(1, best.argmax(1, keepdim=True)).long()


@triton.jit
def _race_kernel(SCORES, stride_s, TEMPERATURE, stride_t, KEYS, stride_k, BEST, TOKEN, vocab,
                 SCALE: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """One program: one row's tokens ``split * SPLIT ..`` ; writes its best score and token."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(TEMPERATURE + row * stride_t)
    seed = tl.load(KEYS + row * stride_k)
    counter = tl.load(KEYS + row * stride_k + 1)
    stream = tl.load(KEYS + row * stride_k + 2)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    counter_lo = zero + (counter & 0xFFFFFFFF).to(tl.uint32)
    counter_hi = zero + (counter >> 32).to(tl.uint32)
    stream = zero + stream.to(tl.uint32)
    base = SCORES + row.to(tl.int64) * stride_s
    best = tl.full([], float("-inf"), tl.float32)
    best_token = tl.full([], 0, tl.int32)
    for offset in range(0, SPLIT, BLOCK):
        tokens = split * SPLIT + offset + tl.arange(0, BLOCK)
        valid = tokens < vocab
        x = tl.load(base + tokens, mask=valid, other=float("-inf")).to(tl.float32)
        if temperature > 0:
            if SCALE:
                x = tl.minimum(x / temperature, FLOAT32_MAX)
            bits, _, _, _ = tl.philox(seed, tokens, counter_lo, counter_hi, stream)
            u = ((bits >> 8).to(tl.float32) + 1.0) * (1.0 / 16777216.0)  # (0, 1], exact in float32
            x = x - tl.log(tl.maximum(-tl.log(u), 3.0e-8))  # an exponential's -log: Gumbel noise
        x = tl.where(valid, x, float("-inf"))
        block_best = tl.max(x, 0)
        better = block_best > best
        best_token = tl.where(better, split * SPLIT + offset + tl.argmax(x, 0), best_token)
        best = tl.where(better, block_best, best)
    tl.store(BEST + row * tl.num_programs(1) + split, best)
    tl.store(TOKEN + row * tl.num_programs(1) + split, best_token)
