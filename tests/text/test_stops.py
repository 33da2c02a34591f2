"""Stop strings: whole-text matching, streaming, and their agreement on any split of the text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllama.text.stops import StopMatch, StopMatcher

ALPHABET = "ab\n"
stop_lists = st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3)
texts = st.text(ALPHABET, max_size=40)


def stream_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, str | None]:
    stream = matcher.stream()
    output = "".join(stream.push(piece) for piece in pieces) + stream.finish()
    return output, stream.stop_reason


@st.composite
def split_texts(draw: st.DrawFn) -> list[str]:
    text = draw(texts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return [text[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


def test_truncates_before_the_stop() -> None:
    assert StopMatcher(["\nUser:"]).apply("Hi there.\nUser: more") == ("Hi there.", "\nUser:")


def test_include_stop_keeps_the_stop() -> None:
    assert StopMatcher(["\nUser:"], include_stop=True).apply("Hi.\nUser: x") == ("Hi.\nUser:", "\nUser:")


def test_no_stop_passes_the_text_through() -> None:
    assert StopMatcher(["###"]).apply("plain text") == ("plain text", None)
    assert StopMatcher([]).apply("plain text") == ("plain text", None)


def test_the_first_stop_to_complete_wins() -> None:
    # "c" completes before "abcd" does, so a stream would stop there; the whole text agrees.
    assert StopMatcher(["abcd", "c"]).find("xabcd") == StopMatch("c", 3, 4)
    assert StopMatcher(["abcd", "c"]).apply("xabcd") == ("xab", "c")


def test_of_stops_ending_together_the_longest_wins() -> None:
    assert StopMatcher(["b", "ab"]).find("xab") == StopMatch("ab", 1, 3)
    assert StopMatcher(["b", "ab"], include_stop=True).apply("xabz") == ("xab", "ab")


def test_earliest_occurrence_wins_among_unrelated_stops() -> None:
    assert StopMatcher(["END", "STOP"]).apply("a STOP b END") == ("a ", "STOP")


def test_stream_holds_back_a_possible_stop_across_pieces() -> None:
    stream = StopMatcher(["</answer>"]).stream()
    assert stream.push("The result is 4<") == "The result is 4"
    assert stream.push("/ans") == ""
    assert not stream.stopped
    assert stream.push("wer> trailing") == ""
    assert stream.stopped and stream.stop_reason == "</answer>"
    assert stream.push("ignored") == ""
    assert stream.finish() == ""


def test_stream_releases_a_tail_that_stops_matching() -> None:
    stream = StopMatcher(["</answer>"]).stream()
    assert stream.push("a </a") == "a "
    assert stream.push("b>") == "</ab>"
    assert stream.push(" <") == " "
    assert stream.finish() == "<"
    assert stream.stop_reason is None


def test_stream_holds_the_longest_suffix_that_could_start_a_stop() -> None:
    # With "aab", the tail "aa" could still become "aab": holding only "a" would be too little.
    stream = StopMatcher(["aab"]).stream()
    assert stream.push("xaa") == "x"
    assert stream.push("ab") == "a"
    assert stream.stop_reason == "aab"


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_empty_stop_strings_are_rejected(stops: list[str]) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        StopMatcher(stops)


def test_a_bare_string_or_non_strings_are_rejected() -> None:
    with pytest.raises(ValueError, match="list of strings"):
        StopMatcher("\n")
    with pytest.raises(ValueError, match="must be strings"):
        StopMatcher([3])  # type: ignore[list-item]


@settings(max_examples=200, deadline=None)
@given(stops=stop_lists, pieces=split_texts(), include_stop=st.booleans())
def test_streaming_equals_matching_the_whole_text(stops: list[str], pieces: list[str], include_stop: bool) -> None:
    matcher = StopMatcher(stops, include_stop=include_stop)
    assert stream_all(matcher, pieces) == matcher.apply("".join(pieces))


@settings(max_examples=200, deadline=None)
@given(stops=stop_lists, pieces=split_texts())
def test_no_stop_string_survives_in_the_output(stops: list[str], pieces: list[str]) -> None:
    output, reason = stream_all(StopMatcher(stops), pieces)
    assert not any(stop in output for stop in stops)
    text = "".join(pieces)
    assert text.startswith(output)
    assert (reason is None) == (output == text and not any(stop in text for stop in stops))


@settings(max_examples=200, deadline=None)
@given(stops=stop_lists, pieces=split_texts())
def test_include_stop_output_ends_at_the_first_completed_stop(stops: list[str], pieces: list[str]) -> None:
    output, reason = stream_all(StopMatcher(stops, include_stop=True), pieces)
    text = "".join(pieces)
    assert text.startswith(output)
    if reason is None:
        assert output == text
    else:
        assert output.endswith(reason)
        assert not any(stop in output[:-1] for stop in stops)


@settings(max_examples=200, deadline=None)
@given(stops=stop_lists, pieces=split_texts())
def test_stream_holds_back_only_what_could_begin_a_stop(stops: list[str], pieces: list[str]) -> None:
    matcher = StopMatcher(stops)
    stream = matcher.stream()
    emitted = seen = ""
    for piece in pieces:
        emitted += stream.push(piece)
        seen += piece
        if stream.stopped:
            break
        assert seen.startswith(emitted)
        assert len(seen) - len(emitted) == longest_possible_stop_start(seen, stops)


def longest_possible_stop_start(text: str, stops: list[str]) -> int:
    """Brute force: the longest suffix of `text` that is a proper prefix of some stop."""
    lengths = [n for n in range(1, len(text) + 1) for stop in stops if len(stop) > n and stop.startswith(text[-n:])]
    return max(lengths, default=0)
