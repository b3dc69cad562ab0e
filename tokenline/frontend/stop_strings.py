"""Stop strings matched on streamed text, across delta (and token) boundaries.

Text is released only when no stop string can still begin inside it: the longest tail of the
text seen so far that is a proper prefix of some stop string is held back until the next delta
decides it. So a stop string split over many deltas never leaks, and a near miss is released as
soon as it stops matching. The result does not depend on how the text was cut into deltas: the
stream stops at the first position where any stop string is complete, as if fed one character
at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Filter a stream of text deltas through a set of stop strings."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        # Empty strings would match everywhere; clients send them by accident, so ignore them.
        self._stops = sorted({s for s in stops if s}, key=len)
        self._include = include_stop_str_in_output
        self._held = ""
        self._stopped = False
        self._closed = False  # flush() was called
        self.matched: str | None = None  # the stop string that ended the stream

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def held(self) -> str:
        """Text held back because it may be the start of a stop string (read-only, for traces)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta; return (text safe to emit now, whether a stop string was hit)."""
        if self._stopped or self._closed:
            return "", self._stopped
        if not self._stops:
            return delta, False
        text = self._held + delta

        # The stop that completes first wins (smallest end); among stops ending at the same
        # place, the longest one (it starts earliest), so less of the text before it is shown.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            # Searching only held tail + delta is enough: text released earlier had no tail
            # that could begin a stop string.
            at = text.find(stop)
            if at < 0:
                continue
            key = (at + len(stop), at, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is not None:
            end, start, stop = best
            self._stopped = True
            self.matched = stop
            self._held = ""
            return (text[:end] if self._include else text[:start]), True

        hold = self._partial_suffix_len(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Generation ended without a stop: release the held-back tail."""
        if self._stopped or self._closed:
            return ""
        tail, self._held = self._held, ""
        self._closed = True
        return tail

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
