"""Statistics on hand-computed cases."""

import math

import pytest

from vivace.bench.client import RequestResult
from vivace.bench.stats import Slo, describe, parse_slo, request_tpot, summarize


def finished(ttft: float, gaps: list[float], output_tokens: int | None = None, **fields: object) -> RequestResult:
    """A successful request whose chunks arrived at ttft, ttft+gaps[0], ..."""
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestResult(sent_at=0.0, chunk_times=times, e2e=times[-1],
                         output_tokens=len(times) if output_tokens is None else output_tokens, **fields)


def failed(kind: str) -> RequestResult:
    return RequestResult(sent_at=0.0, error="boom", error_kind=kind)


def test_describe_matches_hand_computed_figures() -> None:
    dist = describe([0.001, 0.002, 0.003, 0.004])
    assert dist.count == 4
    assert dist.mean == pytest.approx(2.5)
    assert dist.median == pytest.approx(2.5)
    assert dist.std == pytest.approx(math.sqrt(1.25))  # population std of 1, 2, 3, 4
    assert dist.p90 == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert dist.p95 == pytest.approx(3.85)
    assert dist.p99 == pytest.approx(3.97)
    assert dist.max == pytest.approx(4.0)


def test_describe_of_nothing_is_nan() -> None:
    dist = describe([])
    assert dist.count == 0 and math.isnan(dist.mean) and math.isnan(dist.p99)


def test_tpot_excludes_the_first_token() -> None:
    result = RequestResult(sent_at=0.0, chunk_times=[0.1, 0.3], e2e=1.0, output_tokens=10)
    assert request_tpot(result) == pytest.approx((1.0 - 0.1) / 9)
    assert request_tpot(RequestResult(sent_at=0.0, chunk_times=[0.1], e2e=0.1, output_tokens=1)) is None


def test_itl_is_pooled_over_requests_and_ttft_per_request() -> None:
    results = [finished(0.1, [0.01, 0.03]), finished(0.2, [0.02])]
    summary = summarize(results, duration_s=2.0)
    assert summary.itl.count == 3
    assert summary.itl.mean == pytest.approx(20.0)
    assert summary.ttft.mean == pytest.approx(150.0)
    assert summary.e2e.max == pytest.approx(220.0)
    # TPOT per request: (0.14 - 0.1) / 2 = 20 ms and (0.22 - 0.2) / 1 = 20 ms
    assert summary.tpot.mean == pytest.approx(20.0)


def test_throughput_errors_and_goodput() -> None:
    fast = finished(0.1, [0.04] * 9)  # TTFT 100 ms, TPOT 40 ms
    slow_first = finished(0.3, [0.01] * 9)  # TTFT 300 ms
    slow_tokens = finished(0.05, [0.06] * 9)  # TPOT 60 ms
    results = [fast, slow_first, slow_tokens, failed("http_503"), failed("http_503"), failed("timeout")]
    summary = summarize(results, duration_s=4.0, slo=Slo(ttft_ms=200, tpot_ms=50))
    assert (summary.completed, summary.failed) == (3, 3)
    assert summary.errors == {"http_503": 2, "timeout": 1}
    assert summary.output_tokens == 30
    assert summary.request_throughput == pytest.approx(0.75)
    assert summary.output_throughput == pytest.approx(7.5)
    assert summary.goodput == pytest.approx(0.25)


def test_single_token_reply_meets_any_tpot_bound() -> None:
    assert Slo(tpot_ms=1).met_by(finished(0.1, [], output_tokens=1))


def test_prompt_mismatches_counted_only_where_both_lengths_are_known() -> None:
    results = [finished(0.1, [0.01], prompt_tokens=128, expected_prompt_tokens=128),
               finished(0.1, [0.01], prompt_tokens=129, expected_prompt_tokens=128),
               finished(0.1, [0.01], prompt_tokens=129)]
    summary = summarize(results, duration_s=1.0)
    assert summary.prompt_token_mismatches == 1
    assert summary.input_tokens == 128 + 129 + 129


def test_parse_slo_units() -> None:
    assert parse_slo("ttft=200ms,tpot=50ms") == Slo(ttft_ms=200, tpot_ms=50)
    assert parse_slo("e2e=2s, ttft=150") == Slo(ttft_ms=150, e2e_ms=2000)
    with pytest.raises(ValueError):
        parse_slo("latency=1s")
