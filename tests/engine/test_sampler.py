import math

import pytest
import torch

from vivace.engine.request import Request
from vivace.engine.sampler import Sampler, filter_logits
from vivace.engine.sampling_params import SamplingParams


def request(tokens=(5, 6), output=(), **params) -> Request:
    r = Request("r", list(tokens), SamplingParams(**params))
    r.token_ids.extend(output)
    return r


def test_top_k_top_p_min_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = lambda out: torch.isfinite(out).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, 2, 1.0, 0.0)) == [0, 1]
    assert kept(filter_logits(logits, 0, 0.7, 0.0)) == [0, 1]   # 0.5 < 0.7, 0.7 reached with token 1
    assert kept(filter_logits(logits, 0, 0.71, 0.0)) == [0, 1, 2]
    assert kept(filter_logits(logits, 0, 1.0, 0.3)) == [0, 1, 2]  # p >= 0.3 * 0.5
    assert kept(filter_logits(logits, -1, 1.0, 0.0)) == [0, 1, 2, 3, 4]


def sorted_nucleus(logits: torch.Tensor, top_p: float) -> list[int]:
    """The top-p nucleus by sorting the whole row: the reference ``filter_logits`` must agree with."""
    values, order = logits.sort(descending=True)
    probs = values.softmax(-1)
    keep = (probs.cumsum(-1) - probs) < top_p
    keep[0] = True
    return sorted(order[keep].tolist())


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat (the nucleus is most of the row) to peaked
@pytest.mark.parametrize("top_p", [1e-9, 0.5, 0.9, 0.999])
def test_the_nucleus_is_the_one_a_full_sort_gives(scale: float, top_p: float):
    """The nucleus is looked for among the largest 64, 512, ... values; wherever it ends, it is the
    set a sort of the whole row keeps."""
    logits = torch.randn(20_000, generator=torch.Generator().manual_seed(int(scale * 100))) * scale
    kept = torch.isfinite(filter_logits(logits, 0, top_p, 0.0)).nonzero().flatten().tolist()
    assert kept == sorted_nucleus(logits, top_p)
    masked = filter_logits(logits, 300, top_p, 0.0)  # top_k first: the nucleus of what it keeps
    want = sorted_nucleus(logits.masked_fill(logits < logits.topk(300).values[-1], float("-inf")), top_p)
    assert torch.isfinite(masked).nonzero().flatten().tolist() == want


def test_ties_at_a_cut_stay_and_draws_keep_to_the_kept_tokens():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.5])  # three tokens tie for second place
    kept = lambda out: torch.isfinite(out).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, 2, 1.0, 0.0)) == [0, 2, 3, 4]
    assert kept(filter_logits(logits, 0, 0.5, 0.0)) == [0, 2, 3, 4]  # the nucleus cut falls among the ties
    sampler = Sampler(eos_token_ids=(9,))
    for params in (dict(top_k=2), dict(top_p=0.5), dict(min_p=0.3), dict(top_k=3, min_p=0.3, top_p=0.7)):
        allowed = Sampler.probabilities(logits, SamplingParams(temperature=1.0, **params)) > 0
        drawn = {sampler(logits[None].clone(), [request(temperature=1.0, **params)]).token_ids[0] for _ in range(60)}
        assert all(allowed[t] for t in drawn) and len(drawn) > 1, params


def test_penalties_follow_their_definitions():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[1.0, 2.0, -1.0, 3.0, 0.5, 0.0, 0.0]])
    r = request(tokens=(2,), output=(3, 3, 4), repetition_penalty=2.0,
                presence_penalty=0.5, frequency_penalty=0.25, logprobs=0, temperature=0.0)
    out = sampler(logits.clone(), [r])
    expected = torch.tensor([1.0, 2.0, -2.0, 1.5 - 0.5 - 0.5, 0.25 - 0.25 - 0.5, 0.0, 0.0])
    assert out.token_ids == [1]
    assert math.isclose(out.logprobs[0], expected.log_softmax(-1)[1].item(), rel_tol=1e-6)


def test_min_tokens_forbids_eos_and_stop_ids():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[9.0, 8.0, 1.0]])
    assert sampler(logits.clone(), [request(min_tokens=2, temperature=0)]).token_ids == [1]
    assert sampler(logits.clone(), [request(min_tokens=2, temperature=0, stop_token_ids=[1])]).token_ids == [2]
    assert sampler(logits.clone(), [request(temperature=0)]).token_ids == [0]


def test_many_stop_token_ids_cost_each_step_the_same_as_a_few(monkeypatch):
    """Thousands of stop token ids (repeated: a 4 MB body holds ~700,000) are kept once each, and
    the min_tokens ban gathers them into a tensor once per request, not once per step (that
    converted the whole list on the engine thread each step: ~80 ms at 700,000)."""
    sent = [i % 40_000 for i in range(200_000)]
    params = SamplingParams(stop_token_ids=sent, min_tokens=10, temperature=0)
    assert params.stop_token_ids == list(range(40_000)) and 39_999 in params.stop_token_set
    converted = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda data, *a, **k: converted.append(len(data)) or real_tensor(data, *a, **k))
    sampler, r = Sampler(eos_token_ids=(0,)), Request("r", [5], params)
    logits = torch.zeros(1, 50_000)
    logits[0, :40_000] = 1.0
    for _ in range(10):
        token_id = sampler(logits.clone(), [r]).token_ids[0]
        assert token_id >= 40_000
        r.token_ids.append(token_id)
    assert sum(converted) <= 40_001


def test_seeded_draws_do_not_depend_on_the_batch():
    sampler = Sampler(eos_token_ids=(0,))
    torch.manual_seed(1)
    logits = torch.randn(4, 50)

    def draws(rows: list[int], seeds: list[int | None]) -> list[list[int]]:
        requests = [request(seed=s, temperature=1.0, top_p=0.9) for s in seeds]
        return [sampler(logits[rows].clone(), requests).token_ids for _ in range(8)]

    alone = [d[0] for d in draws([2], [7])]
    mixed = [d[1] for d in draws([0, 2, 3], [None, 7, 3])]
    assert alone == mixed
    assert len(set(alone)) > 1  # the generator advances between draws


def test_top_logprobs_are_sorted_and_include_the_argmax():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = sampler(logits, [request(temperature=0, logprobs=3)])
    assert out.top_ids == [[1, 3, 2]]
    assert out.top_logprobs[0] == sorted(out.top_logprobs[0], reverse=True)
    assert math.isclose(out.logprobs[0], out.top_logprobs[0][0])


def test_tiny_temperatures_sample_greedily():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[1.0, 3.0, 2.9, -1.0]])
    for temperature in (1e-308, 5e-324, 1e-6):
        out = sampler(logits.clone(), [request(temperature=temperature, logprobs=1)])
        assert out.token_ids == [1] and math.isfinite(out.logprobs[0])


def test_vanishing_top_p_top_k_and_min_p_keep_the_most_likely_token():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[1.0, 3.0, 2.9, -1.0]])
    for params in (dict(top_p=5e-324), dict(top_p=1e-45), dict(top_k=1), dict(min_p=1.0)):
        draws = {sampler(logits.clone(), [request(temperature=1.0, seed=s, **params)]).token_ids[0]
                 for s in range(20)}
        assert draws == {1}, params


def test_overflowing_penalties_and_temperatures_stay_finite():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5]])
    # The repetition penalty divides the seen positive logits by 1e-308: +inf before saturation.
    r = request(tokens=(1, 3), temperature=1e-5, repetition_penalty=1e-308, seed=3, logprobs=3)
    out = sampler(logits.clone(), [r])
    assert out.token_ids[0] in (1, 3)
    assert all(math.isfinite(v) for v in [out.logprobs[0], *out.top_logprobs[0]])


def test_logprobs_of_forbidden_tokens_are_finite():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[9.0, 1.0, 0.5]])
    out = sampler(logits.clone(), [request(temperature=0, min_tokens=1, stop_token_ids=[2], logprobs=3)])
    assert out.token_ids == [1]
    assert out.top_ids[0][-2:] and sorted(out.top_logprobs[0])[:2] == [-9999.0, -9999.0]


@pytest.mark.parametrize("seed", [0, -(2**63), 2**64 - 1, 2**64 + 5])
def test_every_accepted_seed_works(seed):
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.randn(1, 50)
    first = sampler(logits.clone(), [request(temperature=1.0, seed=seed)]).token_ids
    assert sampler(logits.clone(), [request(temperature=1.0, seed=seed)]).token_ids == first


def test_logit_bias_is_added_first_and_only_to_its_own_row():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]] * 3)
    rows = [request(temperature=0, logit_bias={3: 100.0}), request(temperature=0, logprobs=0),
            request(tokens=(0,), output=(2,), temperature=0, logit_bias={1: -100.0}, repetition_penalty=2.0,
                    logprobs=0)]
    out = sampler(logits.clone(), rows)
    assert out.token_ids == [3, 1, 2]
    assert out.logprobs[1] == pytest.approx(logits[1].log_softmax(-1)[1].item())
    # The bias, then the repetition penalty on the seen tokens 0 and 2.
    expected = torch.tensor([0.5, 3.0 - 100.0, 1.0, 0.5])
    assert math.isclose(out.logprobs[2], expected.log_softmax(-1)[2].item(), rel_tol=1e-6)
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={"3": 5}).logit_bias == {3: 5.0}  # keyed as JSON keys them
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"three": 5})


@pytest.mark.parametrize("bias", [{1: 100.5}, {-1: 1.0}, {1: float("nan")}, {t: 1.0 for t in range(301)}])
def test_bad_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_verification_sees_the_logit_bias():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]] * 3)
    r = request(temperature=0, logit_bias={3: 100.0})
    assert sampler.verify(logits.clone(), r, [3, 1]).token_ids == [3, 3]  # the proposal's 1 is rejected


def test_the_callers_logits_are_left_as_they_are():
    """The engine hands the sampler a view of the step's logits: bias, penalties and the
    min_tokens ban work on a copy."""
    logits = torch.randn(2, 7)
    before = logits.clone()
    requests = [request(output=(3,), logit_bias={2: 50.0}, repetition_penalty=1.5, temperature=0.0),
                request(min_tokens=4, temperature=0.0)]
    out = Sampler(eos_token_ids=(0,))(logits, requests)
    assert out.token_ids[0] == 2 and torch.equal(logits, before)
