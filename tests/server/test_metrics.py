"""``/metrics``: every documented metric is exposed, and a request moves the right ones;
``/debug/timings`` lists the events behind the timing histograms."""

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
    "vivace:spec_decode_mean_accepted_length", "vivace:server_work_seconds_count",
]
# The engine's own step timings: a single-process server exposes them; behind Ray Serve each
# replica keeps its own (the ingress does not aggregate them yet).
ENGINE_TIMINGS = ["vivace:engine_step_seconds_count", "vivace:engine_handoff_seconds_count",
                  "vivace:gc_pause_seconds_count"]


def test_documented_metrics_are_exposed(server: RunningServer) -> None:
    assert_exposed(server, DOCUMENTED + ENGINE_TIMINGS)


def assert_exposed(server: RunningServer, names: list[str]) -> None:
    server.client().completions.create(model="tiny", prompt="warm", max_tokens=2)
    with server.http() as http:
        text = http.get("/metrics").text
    for name in names:
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


def test_a_streamed_chat_moves_the_timing_histograms_and_lists_its_events(server: RunningServer) -> None:
    def count(name: str, **labels: str) -> float:
        return metric_value(server, f"vivace:{name}_count", **labels)

    before = {phase: count("engine_step_seconds", phase=phase) for phase in ("forward", "total")}
    work_before = {work: count("server_work_seconds", work=work) for work in ("parse", "prompt", "sse_write")}
    with server.http() as http:
        since = http.get("/debug/timings").json()["now"]
    stream = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a b c"}], max_tokens=4, stream=True,
        extra_body={"ignore_eos": True})
    assert len([chunk for chunk in stream]) >= 5
    for phase, value in before.items():
        assert count("engine_step_seconds", phase=phase) - value >= 4  # one step per token at least
    assert count("server_work_seconds", work="parse") - work_before["parse"] == 1
    assert count("server_work_seconds", work="prompt") - work_before["prompt"] == 1
    assert count("server_work_seconds", work="sse_write") - work_before["sse_write"] >= 5
    with server.http() as http:
        timings = http.get("/debug/timings", params={"since": since}).json()
        assert http.get("/debug/timings", params={"since": "soon"}).status_code == 400
    steps = timings["steps"]
    assert sum(step["decode_tokens"] for step in steps) >= 3
    assert all(since <= step["start"] <= timings["now"] and step["total"] >= step["forward"] > 0 for step in steps)
    assert {"start", "lag"} <= set(timings["handoffs"][0])
    assert len(timings["prompt"]) == 1 and timings["prompt"][0]["seconds"] > 0


def test_token_counters_move_while_a_request_streams(server: RunningServer) -> None:
    """As vLLM's, what was generated so far is counted before the request ends: read at the 10th
    chunk, the counter holds at least 10 tokens, and (the request being long enough that the
    server cannot have run it to its end by the time the client has read 10 chunks: 40 tokens
    could, once the tiny model's steps got fast) fewer than all of them."""
    max_tokens = 200
    before = [metric_value(server, f"vivace:{name}_tokens_total") for name in ("prompt", "generation")]
    stream = server.client().completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=max_tokens, stream=True,
                                                extra_body={"ignore_eos": True})
    chunks = 0
    for chunk in stream:
        chunks += bool(chunk.choices and chunk.choices[0].text is not None)
        if chunks == 10:
            prompt, generated = (metric_value(server, f"vivace:{name}_tokens_total") - b
                                 for name, b in zip(("prompt", "generation"), before))
            assert prompt == 3 and 10 <= generated < max_tokens
    assert metric_value(server, "vivace:generation_tokens_total") - before[1] == max_tokens
