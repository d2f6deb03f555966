"""``/metrics``: every documented metric is exposed, and a request moves the right ones."""

from __future__ import annotations

from .harness import RunningServer, metric_value

DOCUMENTED = [
    "vivace:time_to_first_token_seconds_count", "vivace:inter_token_latency_seconds_count",
    "vivace:e2e_request_latency_seconds_count", "vivace:request_queue_time_seconds_count",
    "vivace:request_prefill_time_seconds_count", "vivace:request_decode_time_seconds_count",
    "vivace:num_requests_running", "vivace:num_requests_waiting", "vivace:kv_cache_usage_perc",
    "vivace:prompt_tokens_total", "vivace:generation_tokens_total",
    "vivace:request_success_total", "vivace:num_preemptions_total",
    "vivace:prefix_cache_queries_total", "vivace:prefix_cache_hits_total",
    "vivace:request_rejected_total", "vivace:request_timeout_total",
    "vivace:spec_decode_num_drafts_total", "vivace:spec_decode_num_draft_tokens_total",
    "vivace:spec_decode_num_accepted_tokens_total", "vivace:spec_decode_acceptance_rate",
    "vivace:spec_decode_mean_accepted_length",
]


def test_documented_metrics_are_exposed(server: RunningServer) -> None:
    server.client().completions.create(model="tiny", prompt="warm", max_tokens=2)
    with server.http() as http:
        text = http.get("/metrics").text
    for name in DOCUMENTED:
        assert f"\n{name}" in text, name


def test_a_request_moves_its_counters_and_histograms(server: RunningServer) -> None:
    before = {name: metric_value(server, name) for name in DOCUMENTED}
    ids = [5, 6, 7, 8, 9]
    server.client().completions.create(model="tiny", prompt=ids, max_tokens=4,
                                       extra_body={"ignore_eos": True})
    after = {name: metric_value(server, name) for name in DOCUMENTED}
    assert after["vivace:prompt_tokens_total"] - before["vivace:prompt_tokens_total"] == 5
    assert after["vivace:generation_tokens_total"] - before["vivace:generation_tokens_total"] == 4
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_decode_time"):
        name = f"vivace:{histogram}_seconds_count"
        assert after[name] - before[name] == 1
    itl = "vivace:inter_token_latency_seconds_count"
    assert after[itl] - before[itl] == 3
