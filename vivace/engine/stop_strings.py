"""A request's stop strings, indexed so that checking a token's text against them costs about the
same for 1,000 long strings as for one: two sorted lists searched by bisection, never a pass over
every string (a pass costs each decoding stream that many comparisons per token of this one)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right


class StopStrings:
    """Non-empty stop strings, in the request's order (the first listed wins a tie)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.longest = max(map(len, stops), default=0)
        self._order: dict[str, int] = {}
        for index, stop in enumerate(stops):
            self._order.setdefault(stop, index)
        self._sorted = sorted(self._order)
        self._reversed = sorted(stop[::-1] for stop in self._order)

    def held_back(self, text: str, at_most: int) -> int:
        """Length of the longest suffix of ``text``, of at most ``at_most`` characters and shorter
        than the longest stop string, that begins some stop string (or is one)."""
        for size in range(min(at_most, self.longest - 1, len(text)), 0, -1):
            suffix = text[-size:]
            i = bisect_left(self._sorted, suffix)  # the strings that begin with it sort first from here
            if i < len(self._sorted) and self._sorted[i].startswith(suffix):
                return size
        return 0

    def first_match(self, text: str, ends_after: int, starts_from: int) -> tuple[int, str] | None:
        """The earliest occurrence (position, stop string) of a stop string in ``text`` that starts
        at ``starts_from`` or later and ends after ``ends_after``; on a tie, the first listed."""
        if not self.stops:
            return None
        best: tuple[int, int] | None = None
        for end in range(max(ends_after, starts_from) + 1, len(text) + 1):
            for size in self._suffix_sizes(text[starts_from:end][::-1]):
                at, index = end - size, self._order[text[end - size:end]]
                if best is None or (at, index) < best:
                    best = (at, index)
        return None if best is None else (best[0], self.stops[best[1]])

    def _suffix_sizes(self, reversed_text: str) -> list[int]:
        """Lengths of the stop strings that end ``text`` (given reversed: that begin it reversed).
        Each probe takes the greatest reversed stop not after the text: it begins the text, or
        none longer than their common prefix can (they would sort between the two)."""
        sizes, head, upper = [], reversed_text, len(self._reversed)
        while head:
            i = bisect_right(self._reversed, head, 0, upper) - 1
            if i < 0:
                break
            candidate, upper = self._reversed[i], i
            if head.startswith(candidate):
                sizes.append(len(candidate))
                head = head[:len(candidate) - 1]
            else:
                head = head[:common_prefix(head, candidate)]
        return sizes


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, in O(log) comparisons made in C."""
    low, high = 0, min(len(a), len(b)) + 1  # a[:low] == b[:low]; a[:high] != b[:high] (or past both)
    while high - low > 1:
        middle = (low + high) // 2
        if a.startswith(b[:middle]):
            low = middle
        else:
            high = middle
    return low
