"""Safety filters on their own: the blocklist (words, regexes, matches split across deltas, the
bounded scan window), the moderation client against a real HTTP server on 127.0.0.1 that speaks
OpenAI's /v1/moderations shape, the per-request output guard, and the configuration errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.moderation_server import ModerationServer, moderation_server
from tokenline.gateway.filters import (
    BlocklistFilter,
    Decision,
    FilterConfigError,
    ModerationFilter,
    OutputGuard,
    load_filter_file,
    parse_filters,
)
from tokenline.gateway.keys import KeyFileError, KeyStore


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --- blocklist ------------------------------------------------------------------------------


def test_blocklist_input_words_are_whole_words_in_any_case() -> None:
    f = BlocklistFilter("words", words=["xylophone", "secret plan"])
    assert run(f.check_input(["I play the XyloPhone."])) == Decision("words", "block", True, "word")
    assert run(f.check_input(["fine", "our Secret Plan is"])).blocked
    assert not run(f.check_input(["xylophones", "a secretplan", "", "nothing"])).blocked


def test_blocklist_patterns_are_case_insensitive_regexes() -> None:
    f = BlocklistFilter("cards", patterns=[r"card\s*\d{4}"])
    assert run(f.check_input(["my CARD 1234"])).reason == "pattern"
    assert not run(f.check_input(["card abcd"])).blocked


def test_blocklist_finds_a_word_split_across_two_deltas() -> None:
    f = BlocklistFilter("words", words=["blue"])
    text = "The sky is bl"
    assert not run(f.check_output(text, 0, final=False)).blocked
    text += "ue today"
    decision = run(f.check_output(text, len("The sky is bl"), final=False))
    assert decision.blocked and decision.verdict == "block"
    assert decision.offset == text.index("blue")  # where the text is cut: before the word


def test_blocklist_blocks_a_word_at_the_end_of_a_delta_at_once() -> None:
    # Waiting for the next character would stream the word first; the filter errs on the safe side.
    f = BlocklistFilter("words", words=["blue"])
    assert run(f.check_output("shade of blue", 9, final=False)).blocked
    assert not run(f.check_output("shade of bluebird", 9, final=True)).blocked


def test_blocklist_scans_only_a_window_before_the_new_delta() -> None:
    f = BlocklistFilter("words", words=["blue"])
    assert f.window == len("blue") + 1
    old = "blue " + "x" * 100  # an old match far behind the window is not scanned again
    assert not run(f.check_output(old + " green", len(old), final=False)).blocked
    near = "x" * 100 + " blu"
    assert run(f.check_output(near + "e", len(near), final=False)).offset == 101


def test_blocklist_pattern_window_bounds_a_regex_across_deltas() -> None:
    f = BlocklistFilter("p", patterns=[r"begin.*end"], pattern_window=20)
    short = "begin 1234 "
    assert run(f.check_output(short + "end", len(short), final=False)).blocked
    long = "begin " + "y" * 40
    assert not run(f.check_output(long + " end", len(long), final=False)).blocked  # longer than the window


# --- the output guard -----------------------------------------------------------------------


def test_output_guard_reports_one_verdict_per_filter_and_choice() -> None:
    reported: list[Decision] = []
    guard = OutputGuard([BlocklistFilter("a", words=["red"]), BlocklistFilter("b", words=["blue"])], reported.append)
    assert run(guard.check("c0", "green", 0, final=False)) is None
    assert reported == []  # allow verdicts wait for the end of the text
    assert run(guard.check("c0", "green sky", 5, final=True)) is None
    assert [(d.filter, d.verdict) for d in reported] == [("a", "allow"), ("b", "allow")]
    assert run(guard.check("c0", "green sky red", 9, final=True)) is None  # the choice is done
    reported.clear()
    block = run(guard.check("c1", "so blue", 0, final=False))
    assert block is not None and block.filter == "b"
    assert run(guard.check("c1", "so blue red", 7, final=True)) is None
    assert [(d.filter, d.verdict) for d in reported] == [("b", "block")]


def test_output_guard_holds_back_the_longest_listed_word_less_one() -> None:
    words = BlocklistFilter("w", words=["red", "shade of blue"])
    mod = ModerationFilter("m", "http://127.0.0.1:1/v1/moderations")
    assert (words.holdback, mod.holdback, BlocklistFilter("p", patterns=[r"card\s*\d{4}"]).holdback) == (12, 0, 0)
    assert OutputGuard([mod, words], print).holdback == 12  # auto: the largest of the filters'
    assert OutputGuard([words], print, holdback=0).holdback == 0  # the operator's --filter-holdback
    assert OutputGuard([words], print, holdback=40).holdback == 40


# --- configuration --------------------------------------------------------------------------


def test_filter_tables_parse_and_bad_ones_name_the_table(tmp_path: Path) -> None:
    filters = parse_filters("cfg", [
        {"type": "blocklist", "words": ["x"], "stages": ["output"]},
        {"type": "moderation", "name": "mod", "url": "http://127.0.0.1:1/v1/moderations", "on_error": "allow"},
    ])
    assert [(f.name, sorted(f.stages)) for f in filters] == [("blocklist", ["output"]), ("mod", ["input", "output"])]
    bad = [
        ({"type": "regex"}, "type must be one of"),
        ({"type": "blocklist"}, "needs words or patterns"),
        ({"type": "blocklist", "words": ["x"], "colour": 1}, "unknown field(s) colour"),
        ({"type": "blocklist", "patterns": ["("]}, "patterns[0] is not a valid regex"),
        ({"type": "blocklist", "words": ["x"], "stages": ["middle"]}, "stages must be a subset"),
        ({"type": "moderation", "url": "ftp://x"}, "url must be"),
        ({"type": "moderation", "url": "http://x", "on_error": "maybe"}, "on_error must be"),
        ({"type": "moderation", "url": "http://x", "timeout_s": 0}, "timeout_s must be a positive number"),
    ]
    for table, message in bad:
        with pytest.raises(FilterConfigError, match="cfg content_filter #1") as info:
            parse_filters("cfg", [table])
        assert message in str(info.value)
    with pytest.raises(FilterConfigError, match="share a name"):
        parse_filters("cfg", [{"type": "blocklist", "words": ["x"]}, {"type": "blocklist", "words": ["y"]}])

    toml = tmp_path / "filters.toml"
    toml.write_text('[[content_filter]]\ntype = "blocklist"\nname = "w"\nwords = ["x"]\n')
    assert [f.name for f in load_filter_file(toml)] == ["w"]
    as_json = tmp_path / "filters.json"
    as_json.write_text(json.dumps({"content_filter": [{"type": "blocklist", "patterns": ["a+"]}]}))
    assert [f.name for f in load_filter_file(as_json)] == ["blocklist"]
    as_json.write_text('{"filters": []}')
    with pytest.raises(FilterConfigError, match="only content_filter tables"):
        load_filter_file(as_json)


def test_keys_file_tenants_carry_their_own_filters(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f"""
[[tenant]]
name = "a"
key_sha256 = "{'a' * 64}"
[[tenant.content_filter]]
type = "blocklist"
words = ["xylophone"]

[[tenant]]
name = "b"
key_sha256 = "{'b' * 64}"
content_filter = []

[[tenant]]
name = "c"
key_sha256 = "{'c' * 64}"
""")
    store = KeyStore.from_file(keys)
    a, b, c = (store.get(n) for n in "abc")
    assert [f.name for f in a.content_filters] == ["blocklist"]
    assert b.content_filters == ()  # explicitly none
    assert c.content_filters is None  # the server's default
    keys.write_text(keys.read_text().replace('words = ["xylophone"]', 'words = "xylophone"'))
    with pytest.raises(KeyFileError, match=r"tenant #1 \('a'\) content_filter #1 .*words must be a list"):
        KeyStore.from_file(keys)


# --- moderation against a real HTTP server ----------------------------------------------------


@pytest.fixture(scope="module")
def moderation() -> Iterator[ModerationServer]:
    with moderation_server() as server:
        yield server


def _moderate(filter_: ModerationFilter, texts: list[str]) -> Decision:
    async def go() -> Decision:
        try:
            return await filter_.check_input(texts)
        finally:
            await filter_.aclose()

    return run(go())


def test_moderation_flags_through_the_service(moderation: ModerationServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_MODERATION_KEY", "sk-mod")
    f = ModerationFilter("mod", moderation.url + "/v1/moderations", model="omni-moderation-latest",
                         api_key_env="TEST_MODERATION_KEY")
    moderation.seen.clear()
    assert _moderate(f, ["hello", "this is FORBIDDEN"]) == Decision("mod", "block", True, "violence")
    assert _moderate(f, ["hello", "", "all fine"]) == Decision("mod", "allow", False)
    first, second = moderation.seen
    assert first["auth"] == "Bearer sk-mod"
    assert first["body"] == {"input": ["hello", "this is FORBIDDEN"], "model": "omni-moderation-latest"}
    assert second["body"]["input"] == ["hello", "all fine"]  # empty texts are not sent


def test_moderation_blocks_only_the_listed_categories(moderation: ModerationServer) -> None:
    url = moderation.url + "/v1/moderations"
    assert not _moderate(ModerationFilter("mod", url, categories=["hate"]), ["forbidden"]).blocked
    assert _moderate(ModerationFilter("mod", url, categories=["violence"]), ["forbidden"]).reason == "violence"


@pytest.mark.parametrize("where", ["/slow", "/broken", "/garbage", "/missing-key"])
def test_moderation_failures_follow_the_on_error_policy(moderation: ModerationServer, where: str) -> None:
    url = moderation.url + ("" if where == "/missing-key" else where) + "/v1/moderations"
    extra = {"api_key_env": "TOKENLINE_TEST_UNSET_KEY"} if where == "/missing-key" else {}
    closed = _moderate(ModerationFilter("mod", url, timeout_s=0.3, **extra), ["hello"])
    assert (closed.verdict, closed.blocked) == ("error", True)  # the default: fail-closed
    assert closed.reason.startswith("moderation service:")
    opened = _moderate(ModerationFilter("mod", url, timeout_s=0.3, on_error="allow", **extra), ["hello"])
    assert (opened.verdict, opened.blocked) == ("error", False)


def test_moderation_output_is_checked_in_bounded_windows(moderation: ModerationServer) -> None:
    f = ModerationFilter("mod", moderation.url + "/v1/moderations", output_chars=20, overlap_chars=5)

    async def stream(deltas: list[str]) -> list[Decision]:
        text, out = "", []
        try:
            for i, delta in enumerate(deltas):
                start, text = len(text), text + delta
                out.append(await f.check_output(text, start, final=i == len(deltas) - 1))
        finally:
            await f.aclose()
        return out

    moderation.seen.clear()
    decisions = asyncio.run(stream(["a" * 8, "b" * 8, "c" * 8, "d" * 8, "e" * 8, "f" * 3]))
    assert not any(d.blocked for d in decisions)
    sent = [s["body"]["input"][0] for s in moderation.seen]
    # Checks where the text crosses 20 and 40 characters, and at its end; each window reaches back
    # to the previous mark minus the overlap, so every character is sent at least once.
    assert sent == ["a" * 8 + "b" * 8 + "c" * 8, "b" + "c" * 8 + "d" * 8 + "e" * 8, "e" * 5 + "fff"]
    moderation.seen.clear()
    decisions = asyncio.run(stream(["fine words ", "and then", " forbidden"]))
    assert [d.verdict for d in decisions] == ["allow", "allow", "block"]
    assert len(moderation.seen) == 1  # one call for the three deltas
