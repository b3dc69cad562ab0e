"""Stop strings: matched across deltas, never leaked, near misses released."""

from __future__ import annotations

import random

import pytest

from tokenline.frontend.stop_strings import StopStringMatcher


def run(stops: list[str], deltas: list[str], include: bool = False) -> tuple[list[str], bool]:
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    out = []
    stopped = False
    for d in deltas:
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return out, stopped


def reference(stops: list[str], text: str, include: bool) -> tuple[str, bool]:
    """Character by character: stop at the first position where some stop string ends."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            longest = max(ending, key=len)
            return (text[:end] if include else text[: end - len(longest)]), True
    return text, False


def test_stop_spanning_many_deltas() -> None:
    out, stopped = run(["<|end|>"], ["Hello", " world", "<", "|", "en", "d", "|>", " after"])
    assert stopped
    assert "".join(out) == "Hello world"
    # Nothing of the stop string was ever emitted, even partially.
    assert out == ["Hello", " world", "", "", "", "", ""]


def test_include_stop_str_in_output() -> None:
    out, stopped = run(["STOP"], ["abc S", "TO", "Pdef"], include=True)
    assert stopped and "".join(out) == "abc STOP"


def test_overlapping_prefixes() -> None:
    stops = ["ab", "abc", "aab"]
    assert run(stops, ["xa", "b", "c"]) == (["x", ""], True)  # "ab" completes before "abc" could
    assert run(stops, ["xa", "a", "b"]) == (["x", "", ""], True)  # "aab" and "ab" end together: the longer wins
    assert run(stops, ["xaab"]) == (["x"], True)  # "aab" and "ab" end together: cut before the longer
    assert run(stops, ["xa", "c"], include=True) == (["x", "ac", ""], False)
    assert run(["abc", "bcd"], ["ab", "cd"]) == (["", ""], True)


def test_near_miss_is_released() -> None:
    m = StopStringMatcher(["</answer>"])
    assert m.feed("The ") == ("The ", False)
    assert m.feed("</ans") == ("", False)  # could still become the stop
    assert m.feed("wer is") == ("</answer is", False)  # no longer can: released at once
    assert m.feed(" <") == (" ", False)
    assert m.flush() == "<"  # generation ended: the held tail is released
    assert m.feed("more") == ("", False)
    assert m.flush() == ""


def test_unicode_stops() -> None:
    assert "".join(run(["。"], ["你好", "世界。", "再见"])[0]) == "你好世界"
    assert "".join(run(["👋🏽"], ["hi 👋", "🏽 bye"])[0]) == "hi "
    out, stopped = run(["終わり"], ["これで終", "わ", "りです"], include=True)
    assert stopped and "".join(out) == "これで終わり"
    assert run(["👋🏽"], ["👋 no skin tone"]) == (["👋 no skin tone", ""], False)


def test_nothing_after_stop() -> None:
    m = StopStringMatcher(["\n\n"])
    assert m.feed("line\n") == ("line", False)
    assert m.feed("\nnext") == ("", True)
    assert m.matched == "\n\n"
    assert m.feed("more text") == ("", True)
    assert m.flush() == ""


def test_no_stops_passes_through() -> None:
    m = StopStringMatcher(["", ""])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_matches_character_reference_on_random_splits(include: bool) -> None:
    rng = random.Random(1)
    alphabet = "aab c"
    for _ in range(2000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        out, stopped = run(stops, deltas, include)
        expected, expected_stopped = reference(stops, text, include)
        assert ("".join(out), stopped) == (expected, expected_stopped), (stops, deltas)
        # Emitted text never runs ahead of what the final answer allows (no leak, no retraction).
        emitted = ""
        for piece in out:
            emitted += piece
            assert expected.startswith(emitted)
