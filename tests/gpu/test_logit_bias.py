"""``logit_bias`` on the device sampler: the host sampler's tokens and logprobs in a batch that mixes
biased, penalized and plain rows, a batch without bias staged after one with it adds nothing, and
only the plan that processes logits pays for it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace.engine.sampler import Sampler  # noqa: E402
from vivace.gpu.sampler import SamplerPlan  # noqa: E402

from .conftest import DEVICE  # noqa: E402
from .test_sampler import EOS, make_request, make_sampler, random_logits  # noqa: E402


def test_biased_rows_equal_the_host_sampler_and_leave_the_others_alone() -> None:
    requests = [make_request(temperature=0, logit_bias={7: 100.0}, logprobs=2),
                make_request(temperature=0, logprobs=2),
                make_request([3, 7], temperature=0, logit_bias={0: 5.0, 31: -100.0, 12: 3.5}, repetition_penalty=1.5,
                             logprobs=2),
                make_request(temperature=0.9, seed=5, logit_bias={9: 100.0})]
    logits = random_logits(len(requests), seed=5)
    logits[2, 31] = logits[2].max() + 50  # the greedy token, until its bias of -100
    want = Sampler(EOS)(logits.clone(), requests)
    assert want.token_ids[0] == 7 and want.token_ids[2] != 31 and want.token_ids[3] == 9
    sampler = make_sampler()
    assert sampler.stage(requests) == SamplerPlan(process=True, logprobs=True)
    got = sampler.run(logits.to(DEVICE), requests)
    assert got.tokens.token_ids == want.token_ids
    assert got.tokens.top_ids[:3] == want.top_ids[:3]
    torch.testing.assert_close(torch.tensor(got.tokens.logprobs[:3]), torch.tensor(want.logprobs[:3]),
                               rtol=0, atol=1e-5)


def test_a_batch_after_a_biased_one_is_unbiased() -> None:
    sampler = make_sampler(max_rows=4)
    logits = random_logits(3, seed=6).to(DEVICE)
    biased = [make_request(temperature=0, logit_bias={t: -100.0 for t in range(30)}) for _ in range(3)]
    assert all(t >= 30 for t in sampler.run(logits, biased).tokens.token_ids)
    penalized = [make_request(temperature=0, presence_penalty=0.1) for _ in range(3)]  # a plan that adds the bias
    assert sampler.stage(penalized) == SamplerPlan(process=True)
    assert not sampler.bias_values.any() and sampler.biased_rows == 0
    assert sampler.run(logits, penalized).tokens.token_ids == Sampler(EOS)(logits.cpu(), penalized).token_ids
    assert sampler.stage([make_request(temperature=0)]) == SamplerPlan()
