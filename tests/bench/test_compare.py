"""Side-by-side Markdown tables with ratios to the baseline server."""

from vivace.bench.compare import Figure, ratio, side_by_side
from vivace.bench.stats import summarize

from .test_stats import finished


def test_ratio_guards_missing_and_zero() -> None:
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(None, 4.0) is None and ratio(2.0, 0.0) is None and ratio(float("nan"), 1.0) is None


def test_side_by_side_has_one_ratio_column_per_peer() -> None:
    fast = summarize([finished(0.1, [0.01, 0.01])], duration_s=1.0)
    slow = summarize([finished(0.2, [0.04, 0.04])], duration_s=1.0)
    figures = [Figure("decode", "median ITL", "ms", lambda s: s.itl.median),
               Figure("decode", "median TTFT", "ms", lambda s: s.ttft.median),
               Figure("long", "median TTFT", "ms", lambda s: s.ttft.median)]
    table = side_by_side(figures, {"vivace": {"decode": fast}, "peer": {"decode": slow}, "broken": {}}, "vivace")
    lines = table.splitlines()
    assert lines[0] == "| workload | figure | vivace | peer | broken | vivace/peer | vivace/broken |"
    assert lines[2] == "| decode | median ITL (ms) | 10.00 | 40.00 | – | 0.25x | – |"
    assert lines[3] == "| decode | median TTFT (ms) | 100.0 | 200.0 | – | 0.50x | – |"
    assert lines[4] == "| long | median TTFT (ms) | – | – | – | – | – |"


def test_side_by_side_of_several_runs_shows_each_figures_median() -> None:
    runs = [summarize([finished(0.1, [gap, gap])], duration_s=1.0) for gap in (0.01, 0.03, 0.02)]
    peer = summarize([finished(0.2, [0.04, 0.04])], duration_s=1.0)
    figures = [Figure("decode", "median ITL", "ms", lambda s: s.itl.median)]
    table = side_by_side(figures, {"vivace": {"decode": runs}, "peer": {"decode": [peer]}}, "vivace")
    assert table.splitlines()[2] == "| decode | median ITL (ms) | 20.00 | 40.00 | 0.50x |"
