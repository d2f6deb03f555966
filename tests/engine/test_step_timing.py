"""Timing logs: histograms count by bucket, rings keep the latest events, GC pauses are seen."""

from __future__ import annotations

import gc

from vivace.engine.step_timing import DurationHistogram, StepTimings, TimingLog, timed, work_log


def test_a_histogram_counts_cumulatively_by_upper_bound() -> None:
    histogram = DurationHistogram((0.01, 0.1))
    for value in (0.005, 0.01, 0.05, 3.0):
        histogram.observe(value)
    buckets, total = histogram.snapshot()
    assert buckets == [(0.01, 2), (0.1, 3), (float("inf"), 4)]  # a bound includes its own value
    assert total == 3.065


def test_a_log_keeps_the_latest_events_and_counts_them_all() -> None:
    log = TimingLog(("start", "seconds", "kind"), ("seconds",), capacity=3)
    for i in range(5):
        log.record(float(i), 0.001 * i, "x")
    assert [row["start"] for row in log.rows()] == [2.0, 3.0, 4.0]
    assert [row["start"] for row in log.rows(since=3.0)] == [3.0, 4.0]
    assert log.histograms["seconds"].snapshot()[0][-1] == (float("inf"), 5)


def test_timed_records_the_body_even_when_it_raises() -> None:
    log = work_log()
    try:
        with timed(log):
            raise KeyError("x")
    except KeyError:
        pass
    [row] = log.rows()
    assert row["seconds"] >= 0


def test_steps_record_each_phase_and_gc_pauses_are_watched() -> None:
    timings = StepTimings()
    timings.record_step([1.0, 1.001, 1.011, 1.012, 1.014, 1.015], decode_tokens=8, prompt_tokens=16,
                        prompt_budget=40, path="prefill")
    [step] = timings.steps.rows()
    assert step["forward"] == 1.011 - 1.001
    assert abs(step["total"] - 0.015) < 1e-12 and step["prompt_tokens"] == 16
    assert step["path"] == "prefill"
    timings.watch_gc()
    try:
        gc.collect()
    finally:
        timings.unwatch_gc()
    gc.collect()  # no longer watched
    [pause] = timings.gc.rows()
    assert pause["generation"] == 2 and pause["pause"] > 0
