"""Stop strings: end generation when the decoded text contains one, on whole texts or on streamed pieces.

Which stop wins: generation ends at the first point where the text contains a stop string. Among the
occurrences, the one that ends first wins, and of those ending at the same place the longest (so the one
that starts first). When no stop string contains another this is simply the earliest occurrence. The rule
depends only on the text up to the match, so a stream fed any split of a text ends exactly where the whole
text does: e.g. with stops "abcd" and "c", the text "abcd" stops at "c" either way.

The output is the text before the stop string, or up to its end with `include_stop`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxllama.errors import InvalidParameter


@dataclass(frozen=True)
class StopMatch:
    """An occurrence of a stop string: `text[start:end] == stop`."""

    stop: str
    start: int
    end: int


class StopMatcher:
    """Finds stop strings in decoded text.

    Args:
        stops: the stop strings (non-empty; duplicates are ignored).
        include_stop: keep the stop string at the end of the output instead of cutting before it.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if isinstance(stops, str):
            raise InvalidParameter(f"stop: must be a list of strings, not the string {stops!r}", "stop")
        for stop in stops:
            if not isinstance(stop, str):
                raise InvalidParameter(f"stop: stop strings must be strings, got {stop!r}", "stop")
            if not stop:
                raise InvalidParameter("stop: stop strings must not be empty", "stop")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.include_stop = include_stop

    def find(self, text: str) -> StopMatch | None:
        """The occurrence that ends generation (see the module docstring), or None."""
        best = None
        for stop in self.stops:
            start = text.find(stop)
            if start < 0:
                continue
            match = StopMatch(stop, start, start + len(stop))
            if best is None or (match.end, match.start) < (best.end, best.start):
                best = match
        return best

    def apply(self, text: str) -> tuple[str, str | None]:
        """The output for a whole text, and the stop string that ended it (None when none occurs)."""
        match = self.find(text)
        if match is None:
            return text, None
        return text[: self.output_end(match)], match.stop

    def stream(self) -> StopStream:
        """A fresh `StopStream` for one generated sequence."""
        return StopStream(self)

    def partial_stop_length(self, text: str) -> int:
        """The length of the longest suffix of `text` that is a proper prefix of a stop string.

        That tail could still become (the start of) a stop string, so a stream must hold it back.
        """
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def output_end(self, match: StopMatch) -> int:
        """Where the output ends for a match: before the stop string, or after it with `include_stop`."""
        return match.end if self.include_stop else match.start


class StopStream:
    """Applies a `StopMatcher` to text arriving in pieces (e.g. from an incremental detokenizer).

    `push` returns the text that is safe to emit now: everything except the tail that could still begin a stop
    string, which is held back until the next pieces settle it. Emitted text is never taken back, and the
    concatenation of all `push` results and `finish()` equals `matcher.apply(whole_text)[0]` for any split.
    """

    def __init__(self, matcher: StopMatcher) -> None:
        self._matcher = matcher
        self._held = ""
        self.stop_reason: str | None = None
        """The stop string that ended the stream, or None while it has not stopped."""

    @property
    def stopped(self) -> bool:
        """Whether a stop string has occurred; later pieces are ignored."""
        return self.stop_reason is not None

    def push(self, piece: str) -> str:
        """Add the next piece of text; return the text that can be emitted now ("" once stopped)."""
        if self.stopped:
            return ""
        text = self._held + piece
        match = self._matcher.find(text)
        if match is not None:
            self.stop_reason = match.stop
            self._held = ""
            return text[: self._matcher.output_end(match)]
        emit = len(text) - self._matcher.partial_stop_length(text)
        self._held = text[emit:]
        return text[:emit]

    def finish(self) -> str:
        """End of the text: return the held-back tail, which can no longer become a stop string."""
        held, self._held = self._held, ""
        return held
