"""StopMatcher: stop strings across chunk boundaries, hold-back and release, flush."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.request.stops import StopMatcher


def run(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    """Feed chunks until a stop; return the emitted pieces (flush included) and stopped."""
    m = StopMatcher(stops)
    out: list[str] = []
    for chunk in chunks:
        text, stopped = m.feed(chunk)
        out.append(text)
        if stopped:
            return out, True
    out.append(m.flush())
    return out, False


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher([])
    assert m.feed("Hello") == ("Hello", False)
    assert m.feed("") == ("", False)
    assert m.flush() == ""


def test_stop_across_token_boundary() -> None:
    m = StopMatcher(["llo"])
    assert m.feed("Hel") == ("He", False)  # "l" might start "llo"
    assert m.feed("lo world") == ("", True)  # "He" was already emitted; the rest is dropped
    assert m.stopped


def test_stop_spanning_many_feeds() -> None:
    out, stopped = run(["</answer>"], ["The answer", " is 4<", "/ans", "wer", ">junk"])
    assert stopped
    assert "".join(out) == "The answer is 4"


def test_partial_match_released_when_it_does_not_complete() -> None:
    m = StopMatcher(["llo"])
    assert m.feed("Hel") == ("He", False)
    assert m.feed("p") == ("lp", False)  # "lp" cannot start "llo": released
    assert m.feed("l") == ("", False)
    assert m.feed("l") == ("", False)  # "ll" still might be "llo"
    assert m.feed("!") == ("ll!", False)
    assert m.flush() == ""


def test_multiple_stops_earliest_wins() -> None:
    m = StopMatcher(["END", "\n\n", "Q:"])
    assert m.feed("one Q: two\n\nEND") == ("one ", True)
    out, stopped = run(["END", "Q:"], ["a", "Q", ":b END"])
    assert stopped and "".join(out) == "a"


def test_stop_at_the_very_start() -> None:
    assert StopMatcher(["Hi"]).feed("Hi there") == ("", True)
    out, stopped = run(["Hi"], ["H", "i", " there"])
    assert stopped and out == ["", ""]


def test_overlapping_stops() -> None:
    # "abc" and "bcd" overlap; "abc" completes first.
    out, stopped = run(["bcd", "abc"], ["xa", "b", "cd"])
    assert stopped and "".join(out) == "x"
    # Self-overlapping stop: the partial "aa" must not hide a match starting one char later.
    out, stopped = run(["aab"], ["a", "a", "a", "b"])
    assert stopped and "".join(out) == "a"


def test_nested_stops_first_completed_wins() -> None:
    # "cd" completes before "abcdef" does, whether or not the text arrives in one chunk.
    for chunks in (["abcdef"], ["ab", "cd", "ef"], list("abcdef")):
        out, stopped = run(["abcdef", "cd"], chunks)
        assert stopped and "".join(out) == "ab"
    # Same end: the one starting first (the longer) wins.
    out, stopped = run(["bc", "abc"], ["xabc"])
    assert stopped and "".join(out) == "x"


def test_flush_releases_held_text() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.flush() == "ST"
    assert m.flush() == ""


def test_feed_after_stop_emits_nothing() -> None:
    m = StopMatcher(["x"])
    assert m.feed("ax b") == ("a", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_unicode_stop_strings() -> None:
    out, stopped = run(["😀中"], ["你好", "😀", "中文"])
    assert stopped and "".join(out) == "你好"
    out, stopped = run(["😀中"], ["你好", "😀", "文"])
    assert not stopped and "".join(out) == "你好😀文"


def test_empty_and_duplicate_stops_ignored() -> None:
    m = StopMatcher(["", "ab", "ab"])
    assert m.feed("xyz") == ("xyz", False)
    assert m.feed("a") == ("", False)
    assert m.feed("b") == ("", True)


def test_hold_back_is_bounded() -> None:
    m = StopMatcher(["aaab", "c"])
    emitted = ""
    for _ in range(100):
        text, stopped = m.feed("a")
        assert not stopped
        emitted += text
    # Never more than len("aaab") - 1 characters are held: the rest is released.
    assert len(emitted) == 97
    assert m.feed("b") == ("", True)


ALPHABET = "ab \n😀中"


@st.composite
def text_and_chunks(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, [text[i:j] for i, j in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=500, deadline=None)
@given(text_and_chunks(), st.text(alphabet=ALPHABET, min_size=1, max_size=4))
def test_property_single_stop(tc: tuple[str, list[str]], stop: str) -> None:
    text, chunks = tc
    out, stopped = run([stop], chunks)
    at = text.find(stop)
    assert stopped == (at >= 0)
    assert "".join(out) == (text[:at] if at >= 0 else text)
    assert stop not in "".join(out)
    assert all(stop not in piece for piece in out)


def first_completed(text: str, stops: list[str]) -> str:
    """Reference rule: cut before the occurrence that ends first (ties: starts first)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    return text[: min(hits)[1]] if hits else text


@settings(max_examples=500, deadline=None)
@given(
    text_and_chunks(),
    st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4),
)
def test_property_many_stops_independent_of_chunking(
    tc: tuple[str, list[str]], stops: list[str]
) -> None:
    text, chunks = tc
    out, _ = run(stops, chunks)
    whole, _ = run(stops, [text])
    assert "".join(out) == "".join(whole) == first_completed(text, stops)
    assert not any(s in "".join(out) for s in stops)


def test_long_stop_strings_cost_linear_memory() -> None:
    # A client controls the stop strings: the matcher must not build anything quadratic in
    # their length (every prefix of a 20,000-character stop would be 200 million characters).
    import tracemalloc

    stops = ["x" * 20_000 + "!", "y" * 20_000]
    tracemalloc.start()
    try:
        m = StopMatcher(stops)
        text, stopped = m.feed("x" * 30_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not stopped
    assert text == "x" * 10_000  # 20,000 held: they may still become the first stop
    assert peak < 8 * 1024 * 1024
    assert m.feed("!") == ("", True)  # the held 20,000 were the stop string itself


def test_matching_resumes_inside_a_failed_partial_match() -> None:
    # After "abab" fails to become "ababc", the trailing "ab" is still a live prefix.
    out, stopped = run(["ababc"], ["abab", "abc"])
    assert stopped and "".join(out) == "ab"
