"""``tokenline bench serve --workload multiturn``: the workload as data, its runner, the prefix-cache
figures from /metrics, and one short run against a real server on the default model."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Server, free_port, start_server
from tokenline.bench.multiturn import (
    Conversation,
    Message,
    MultiturnWorkload,
    make_multiturn_workload,
    run_conversations,
)
from tokenline.bench.prefix_cache import (
    PrefixScrape,
    hit_rates,
    parse_prefix_counters,
    parse_upstream_counters,
)
from tokenline.bench.results import RequestResult
from tokenline.bench.serve import BenchServeConfig, run_bench_serve
from tokenline.cli import main as cli_main


def decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def workload(seed: int = 3, conversations: int = 7, groups: int = 3, turns: int = 4) -> MultiturnWorkload:
    return make_multiturn_workload(num_groups=groups, num_conversations=conversations, turns=turns,
                                   system_prompt_len=12, input_len=5, ordinary_ids=list(range(2, 50)),
                                   decode=decode, seed=seed)


def test_groups_share_system_prompts_and_the_seed_decides_everything() -> None:
    w = workload()
    assert len(w.system_prompts) == 3 and len(set(w.system_prompts)) == 3
    assert all(len(s.split()) == 12 for s in w.system_prompts)
    # Spread evenly over the groups (7 over 3: 3, 2, 2), each conversation with its own id and turns.
    assert sorted(Counter(c.group for c in w.conversations).values()) == [2, 2, 3]
    assert len({c.conversation_id for c in w.conversations}) == 7
    assert all(len(c.user_messages) == 4 and all(len(m.split()) == 5 for m in c.user_messages)
               for c in w.conversations)
    assert len({m for c in w.conversations for m in c.user_messages}) == 28  # fresh every turn
    # Every conversation of a group starts with that group's system prompt.
    for c in w.conversations:
        first = w.messages(c, [])
        assert first[0] == {"role": "system", "content": w.system_prompts[c.group]}
    assert workload() == w
    assert workload(seed=4) != w


def test_each_turn_appends_the_answers_in_order() -> None:
    w = workload()
    c = w.conversations[0]
    assert w.messages(c, []) == [{"role": "system", "content": w.system_prompts[c.group]},
                                 {"role": "user", "content": c.user_messages[0]}]
    chat = w.messages(c, ["first answer", "second answer"])
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in chat[1:]] == [c.user_messages[0], "first answer", c.user_messages[1],
                                               "second answer", c.user_messages[2]]
    with pytest.raises(ValueError, match="4 turns"):
        w.messages(c, ["a"] * 4)


def test_runner_keeps_turn_order_feeds_answers_back_and_bounds_concurrency() -> None:
    w = workload(conversations=6, turns=3)
    calls: list[tuple[str, int, list[Message]]] = []
    in_flight = peak = 0

    async def send(conversation: Conversation, turn: int, messages: list[Message]) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        calls.append((conversation.conversation_id, turn, messages))
        # Uneven delays, so conversations interleave and finish out of order.
        await asyncio.sleep(0.001 * (len(calls) % 4))
        in_flight -= 1
        return RequestResult(prompt_len=1, success=True, text=f"answer {conversation.conversation_id} {turn}")

    results = asyncio.run(run_conversations(w, send, max_concurrency=2))
    assert peak == 2
    assert len(results) == 18 and all(r.result.success for r in results)
    for c in w.conversations:
        mine = [(turn, messages) for cid, turn, messages in calls if cid == c.conversation_id]
        assert [turn for turn, _ in mine] == [0, 1, 2]
        for turn, messages in mine:
            answers = [m["content"] for m in messages if m["role"] == "assistant"]
            assert answers == [f"answer {c.conversation_id} {t}" for t in range(turn)]
            assert messages == w.messages(c, answers)


def test_a_failed_turn_ends_its_conversation() -> None:
    w = workload(conversations=2, turns=3)
    sent: list[tuple[str, int]] = []

    async def send(conversation: Conversation, turn: int, messages: list[Message]) -> RequestResult:
        sent.append((conversation.conversation_id, turn))
        ok = not (conversation is w.conversations[0] and turn == 1)
        return RequestResult(prompt_len=1, success=ok, error="" if ok else "HTTP 500: boom", text="a")

    results = asyncio.run(run_conversations(w, send, max_concurrency=1))
    first = w.conversations[0].conversation_id
    assert [t for cid, t in sent if cid == first] == [0, 1]
    by_turn = {(r.conversation, r.turn): r.result for r in results}
    assert len(by_turn) == 6
    assert by_turn[(0, 2)].error == "not sent: turn 2 failed" and not by_turn[(0, 2)].success
    assert all(by_turn[(1, t)].success for t in range(3))


EXPOSITION = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q0}
vllm:prefix_cache_queries_total{{engine="1",model_name="m"}} {q1}
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {h0}
vllm:prefix_cache_hits_total{{engine="1",model_name="m"}} {h1}
"""


def test_fleet_hit_rate_is_summed_hits_over_summed_queries() -> None:
    def scrape(url: str, text: str) -> PrefixScrape:
        return PrefixScrape(parse_prefix_counters(url, text), parse_upstream_counters(url, text))

    url = "http://a/metrics"
    before = scrape(url, EXPOSITION.format(q0=100, q1=150, h0=10, h1=20))
    # Engine 0 looked up 300 more tokens and found 240; engine 1 restarted (its counters fell) and
    # has 100 lookups and 10 hits since.
    after = scrape(url, EXPOSITION.format(q0=400, q1=100, h0=250, h1=10))
    other = scrape("http://b/metrics", EXPOSITION.format(q0=0, q1=0, h0=0, h1=0).replace('engine="1"', 'engine="0"'))
    both = PrefixScrape(before.totals + other.totals, [])
    rate, queries, hits, replicas = hit_rates(both, PrefixScrape(after.totals + other.totals, []))
    assert [(r.engine, r.queries, r.hits) for r in replicas] == [("0", 300, 240), ("1", 100, 10), ("0", 0, 0)]
    assert replicas[0].hit_rate == pytest.approx(0.8) and replicas[2].hit_rate is None
    assert (queries, hits) == (400, 250)
    assert rate == pytest.approx(250 / 400)  # not the mean of the rates (0.45)


FLEET = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{model_name="m"}} {q}
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{model_name="m"}} {h}
# TYPE tokenline:router_prompt_tokens counter
tokenline:router_prompt_tokens_total{{upstream="engine-0"}} {p0}
tokenline:router_prompt_tokens_total{{upstream="engine-1"}} {p1}
# TYPE tokenline:router_prefix_hit_tokens counter
tokenline:router_prefix_hit_tokens_total{{source="predicted",upstream="engine-0"}} 999
tokenline:router_prefix_hit_tokens_total{{source="reported",upstream="engine-0"}} {r0}
tokenline:router_prefix_hit_tokens_total{{source="reported",upstream="engine-1"}} {r1}
"""


def test_one_fleet_url_gives_per_upstream_figures_from_the_reported_hits() -> None:
    def scrape(**v: int) -> PrefixScrape:
        text = FLEET.format(**v)
        return PrefixScrape(parse_prefix_counters("u", text), parse_upstream_counters("u", text))

    before = scrape(q=10, h=0, p0=10, p1=0, r0=0, r1=0)
    after = scrape(q=410, h=200, p0=210, p1=200, r0=150, r1=50)
    rate, queries, hits, replicas = hit_rates(before, after)
    assert (rate, queries, hits) == (0.5, 400, 200)  # the fleet's own summed counters
    assert [(r.engine, r.queries, r.hits, r.hit_rate) for r in replicas] == [
        ("engine-0", 200, 150, 0.75), ("engine-1", 200, 50, 0.25)]


# --- against a real server -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    with start_server(tmp_path_factory.mktemp("multiturn")) as running:
        yield running


def test_real_multiturn_run_hits_the_prefix_cache_on_later_turns(server: Server, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    rc = cli_main(["bench", "serve", "--base-url", server.base_url, "--workload", "multiturn",
                   "--num-groups", "2", "--num-conversations", "3", "--turns", "2", "--system-prompt-len", "64",
                   "--input-len", "16", "--output-len", "6", "--max-concurrency", "2", "--seed", "5",
                   "--replica-metrics-url", f"{server.base_url}/metrics", "--output-json", str(out)])
    table = capsys.readouterr().out
    assert rc == 0, table
    data = json.loads(out.read_text())
    assert (data["workload"], data["num_groups"], data["num_conversations"], data["turns"]) == ("multiturn", 2, 3, 2)
    assert (data["completed"], data["failed"], data["num_prompts"]) == (6, 0, 6)
    assert data["max_in_flight"] == 2 and data["total_output_tokens"] == 6 * 6
    # Turn 2 resends turn 1 (system prompt, user message, answer): most of it is cached.
    first, second = data["cached_tokens_share_by_turn"]
    assert second > 0.5 and second > first
    # The server's counters over the run agree with what the responses reported.
    assert data["prefix_cache_note"] == ""
    assert data["prefix_cache_queries"] == data["total_input_tokens"]
    assert data["prefix_cache_hits"] == data["cached_prompt_tokens"] > 0
    assert data["prefix_cache_hit_rate"] == pytest.approx(data["cached_tokens_share"]) and 0 < data["prefix_cache_hit_rate"] < 1
    (replica,) = data["prefix_cache_replicas"]
    assert replica["url"] == f"{server.base_url}/metrics" and replica["hits"] == data["prefix_cache_hits"]
    assert "prefix cache" in table and "turn 2" in table and "hit rate (/metrics)" in table


def test_unreadable_metrics_leave_the_usage_share_and_say_why(server: Server) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    config = BenchServeConfig(base_url=server.base_url, workload="multiturn", endpoint="chat", num_groups=1,
                              num_conversations=1, turns=2, system_prompt_len=32, input_len=8, output_len=2,
                              replica_metrics_urls=[dead])
    report = asyncio.run(run_bench_serve(config))
    assert (report.completed, report.failed) == (2, 0)
    assert report.prefix_cache_hit_rate is None and report.prefix_cache_replicas == []
    assert report.prefix_cache_note.startswith(f"cannot reach {dead}/metrics")
    assert report.cached_tokens_share_by_turn[1] > 0
    assert "note: no /metrics hit rate: cannot reach" in report.format_table()


def test_multiturn_needs_the_chat_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--workload", "multiturn",
                   "--endpoint", "completions"])
    assert rc == 2
    assert "multiturn workload sends chat messages" in capsys.readouterr().err
