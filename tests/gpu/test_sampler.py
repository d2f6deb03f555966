"""The device sampler against the host sampler (``vivace.engine.sampler``) at a tiny vocabulary:
greedy tokens, penalties, bans and logprobs equal the host's; filtered draws stay inside the set
``filter_logits`` keeps; seeded draws do not depend on the batch; draw frequencies follow the
softmax. Everything is deterministic: fixed logits, fixed seeds."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace.engine.request import Request  # noqa: E402
from vivace.engine.sampler import Sampler, apply_penalties, filter_logits, mask_stop_tokens, saturate  # noqa: E402
from vivace.engine.sampling_params import SamplingParams  # noqa: E402
from vivace.gpu.sampler import (  # noqa: E402
    BANNED, FREQUENCY, MIN_P, TOP_K, TOP_P, DeviceSampler, SamplerPlan, filter_scores, penalize, race)

from .conftest import DEVICE  # noqa: E402

VOCAB = 32
EOS = (1,)


def make_request(output: list[int] = (), prompt: list[int] = (3, 4, 5, 4), **params: object) -> Request:
    request = Request(f"r{id(params)}", list(prompt), SamplingParams(**params))
    request.token_ids += list(output)
    return request


def make_sampler(max_rows: int = 8, seed: int = 0) -> DeviceSampler:
    return DeviceSampler(max_rows, VOCAB, 64, EOS, seed, torch.device(DEVICE))


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def host_processed(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The host sampler's logits after penalties, saturation and bans (what it argmaxes)."""
    logits = logits.clone()
    apply_penalties(logits, requests)
    saturate(logits)
    mask_stop_tokens(logits, requests, EOS)
    return logits


GREEDY_ROWS = [
    dict(temperature=0),
    dict(temperature=0, logprobs=3),
    dict(temperature=0, repetition_penalty=1.7, logprobs=0),
    dict(temperature=0, presence_penalty=0.8, frequency_penalty=1.1, logprobs=5),
    dict(temperature=0, repetition_penalty=1e-30),  # overflows to inf: saturated
    dict(temperature=0, min_tokens=6, stop_token_ids=[7, 9], logprobs=2),
    dict(temperature=0, min_tokens=6, stop_token_ids=[7], ignore_eos=True),
]


def test_greedy_penalties_bans_and_logprobs_equal_the_host_sampler() -> None:
    requests = [make_request([3, 7, 3, 1], **params) for params in GREEDY_ROWS]
    logits = random_logits(len(requests))
    logits[0, 5] = logits[0, 11] = logits[0].max() + 1  # a tie: the first index wins
    for row in range(1, len(requests)):  # the best tokens: eos, output and stop tokens, then 3
        logits[row, [1, 7, 9, 3]] = logits[row].max() + torch.tensor([0.6, 0.5, 0.4, 0.3])
    want = Sampler(EOS)(logits.clone(), requests)
    assert want.token_ids[:4] == [5, 1, 9, 9] and want.token_ids[5:] == [3, 1]  # processing moved some
    got = make_sampler().run(logits.to(DEVICE), requests)
    assert got.finite == [True] * len(requests)
    assert got.tokens.token_ids == want.token_ids
    assert got.tokens.top_ids == want.top_ids
    torch.testing.assert_close(torch.tensor(got.tokens.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
    for ours, theirs in zip(got.tokens.top_logprobs, want.top_logprobs):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-5)
    # The logprobs are log_softmax of the processed logits (before temperature).
    processed = host_processed(logits, requests)
    chosen = processed.log_softmax(-1).gather(1, torch.tensor(want.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(got.tokens.logprobs), chosen, rtol=0, atol=1e-5)


def test_penalties_and_bans_equal_the_hosts_exactly() -> None:
    requests = [make_request([3, 7, 3, 30], **params) for params in GREEDY_ROWS]
    requests[0] = make_request([3, 7, 3, 30], temperature=0, repetition_penalty=0.5, presence_penalty=-2.0,
                               frequency_penalty=2.0)  # penalties that raise logits
    logits = random_logits(len(requests), seed=1)
    sampler = make_sampler()
    assert sampler.stage(requests).process
    rows = len(requests)
    got = penalize(logits.to(DEVICE), sampler.floats[:rows], sampler.ints[:rows], sampler.history[:rows])
    assert torch.equal(got.cpu(), host_processed(logits, requests))


def test_the_race_is_the_first_argmax_for_greedy_rows_whatever_its_split() -> None:
    logits = random_logits(4, seed=2).to(DEVICE)
    logits[1, 3] = logits[1, 20] = logits[1, 29] = 50.0  # ties across splits: the first wins
    logits[2, :] = float("-inf")
    logits[2, 31] = 0.0
    keys = torch.zeros(4, 3, dtype=torch.long, device=DEVICE)
    greedy = torch.zeros(4, device=DEVICE)
    for block, split in ((4, 8), (8, 8), (32, 32)):
        tokens = race(logits, greedy, keys, scale=True, block=block, split=split)
        assert tokens.squeeze(1).tolist() == logits.argmax(-1).tolist()
    # Sampled rows: the noise belongs to (key, counter, stream, token), not to the program.
    hot = torch.full((4,), 0.9, device=DEVICE)
    keys[:, 0], keys[:, 1], keys[:, 2] = torch.tensor([5, 6, 7, 8]), 2**40 + 3, 1
    draws = [race(logits, hot, keys, scale=True, block=b, split=s).tolist() for b, s in ((4, 8), (8, 16), (32, 32))]
    assert draws[0] == draws[1] == draws[2]


FILTERS = [
    dict(top_k=3), dict(top_k=1), dict(top_p=0.5), dict(top_p=1e-9), dict(min_p=0.2), dict(min_p=1.0),
    dict(top_k=6, top_p=0.7), dict(top_k=8, min_p=0.1, top_p=0.9), dict(top_k=VOCAB + 5, top_p=0.95),
    dict(top_k=-1, top_p=0.99, min_p=0.05),
]


@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_filters_keep_what_filter_logits_keeps(temperature: float) -> None:
    logits = random_logits(len(FILTERS), seed=3)
    scaled = saturate(logits / temperature)
    top_k = torch.tensor([f.get("top_k", 0) for f in FILTERS])
    top_p = torch.tensor([f.get("top_p", 1.0) for f in FILTERS])
    min_p = torch.tensor([f.get("min_p", 0.0) for f in FILTERS])
    got = filter_scores(scaled.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE), min_p.to(DEVICE)).cpu()
    for row, params in enumerate(FILTERS):
        want = filter_logits(scaled[row], params.get("top_k", 0), params.get("top_p", 1.0), params.get("min_p", 0.0))
        assert torch.equal(got[row] > float("-inf"), want > float("-inf")), params
        assert torch.equal(got[row][want > float("-inf")], scaled[row][want > float("-inf")])


def test_filtered_draws_stay_inside_the_hosts_set() -> None:
    requests = [make_request(temperature=1.5, **params) for params in FILTERS[:6]]
    requests.append(make_request(temperature=0))  # a greedy row in a filtered batch stays greedy
    logits = random_logits(len(requests), seed=4).to(DEVICE)
    allowed = [Sampler.probabilities(row, r.params).cpu() > 0 for row, r in zip(logits, requests[:-1])]
    sampler = make_sampler()
    drawn: set[tuple[int, int]] = set()
    for _ in range(12):  # unseeded: each step draws afresh
        plan = sampler.stage(requests)
        assert plan == SamplerPlan(filter=True)
        tokens = sampler.read(sampler.sample(logits, plan), list(range(len(requests))), requests).tokens.token_ids
        for row, token in enumerate(tokens[:-1]):
            assert allowed[row][token], (requests[row].params, token)
            drawn.add((row, token))
        assert tokens[-1] == int(logits[-1].argmax())
    assert len({token for row, token in drawn if row == 4}) > 1  # min_p 0.2 of a flat-ish row: not stuck


def draws(sampler: DeviceSampler, request: Request, others: list[Request], row: int, steps: int) -> list[int]:
    """``request``'s tokens over ``steps`` output positions, sampled at ``row`` among ``others``."""
    tokens = []
    for step in range(steps):
        batch = others[:row] + [request] + others[row:]
        logits = random_logits(len(batch), seed=100 + step)
        logits[row] = random_logits(1, seed=step)[0]  # the request's logits depend on its position only
        tokens.append(sampler.run(logits.to(DEVICE), batch).tokens.token_ids[row])
        request.token_ids.append(tokens[-1])
    return tokens


def test_a_seed_draws_the_same_tokens_alone_and_in_any_batch() -> None:
    others = [make_request(temperature=1.0), make_request(temperature=0.8, top_k=5, seed=99),
              make_request(temperature=0, logprobs=2)]
    alone = draws(make_sampler(seed=1), make_request(temperature=1.0, top_p=0.95, seed=7), [], 0, 6)
    batched = draws(make_sampler(seed=2), make_request(temperature=1.0, top_p=0.95, seed=7), others, 2, 6)
    assert alone == batched
    other_seed = draws(make_sampler(seed=1), make_request(temperature=1.0, top_p=0.95, seed=8), [], 0, 6)
    assert other_seed != alone


def test_draw_frequencies_follow_the_softmax() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 400  # rows of the same logits, each its own counter: 400 independent draws
    logits = (probs.log() * 0.5).expand(n, -1).contiguous().to(DEVICE)  # temperature 0.5 undoes the halving
    keys = torch.zeros(n, 3, dtype=torch.long, device=DEVICE)
    keys[:, 0], keys[:, 1] = 1234, torch.arange(n)
    tokens = race(logits, torch.full((n,), 0.5, device=DEVICE), keys, scale=True).squeeze(1).cpu()
    frequencies = torch.bincount(tokens, minlength=4).float() / n
    # Three binomial standard deviations at p = 0.5 are 0.075 (the seed is fixed: no flakiness).
    assert (frequencies - probs).abs().max() < 0.075, frequencies
    assert frequencies[3] > 0


def test_non_finite_rows_are_flagged() -> None:
    requests = [make_request(temperature=0), make_request(temperature=1.0, seed=3), make_request(temperature=0)]
    logits = random_logits(3)
    logits[0, 4] = float("nan")
    logits[1, 9] = float("inf")
    assert make_sampler().run(logits.to(DEVICE), requests).finite == [False, False, True]


def test_staging() -> None:
    sampler = make_sampler(max_rows=4)
    seeded = make_request([9, 9], temperature=0.7, top_k=4, seed=-5)
    assert sampler.stage([None, seeded]) == SamplerPlan(filter=True)
    ints, floats = sampler.ints.cpu(), sampler.floats.cpu()
    assert ints[1, TOP_K] == 4 and ints[1, 1:4].tolist() == [-5, 2, 0]  # seed, output position, own stream
    assert ints[0, 1] == 0 and ints[0, 3] == 1  # the engine's seed, the row's stream
    assert floats[1, TOP_P] == 1.0 and floats[1, MIN_P] == 0 and floats[1, FREQUENCY] == 0
    banned = make_request(temperature=0, min_tokens=1, stop_token_ids=[5, 6])
    assert sampler.stage([banned]) == SamplerPlan(process=True)
    assert sampler.ints[0, BANNED:BANNED + 4].tolist() == [1, 5, 6, VOCAB]
    assert sampler.stage([make_request(temperature=0, top_k=2, logprobs=1)]) == SamplerPlan(logprobs=True)
    assert sampler.supports([seeded, banned])
    assert not sampler.supports([make_request(temperature=0)] * 5)
    assert not sampler.supports([make_request(temperature=0, min_tokens=2, stop_token_ids=list(range(20)))])
    constrained = make_request(temperature=0)
    constrained.matcher = object()
    assert not sampler.supports([constrained])
    assert math.isclose(sampler.floats[0, 0].item(), 0.0)
