"""One tenant sending many distinct heavy structured-output specs cannot grow the engine without
bound: compiled grammars are kept within ``--grammar-cache-bytes``, least recently used evicted.

Each spec here, ``((a{100}){100}){3}z<tag>x<i>``, builds ~11 MiB of lexer when it compiles, so
200 of them kept for good would add ~2.2 GiB to the engine; the engine's resident memory must stay
within the cache bound + 10 % over what it was after a warm-up. The figures are printed (``-s``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import Server, start_server
from tests.reliability.conftest import chat_body, engine_pid, rss_kib

pytestmark = pytest.mark.reliability

BOUND = 256 << 20  # the default --grammar-cache-bytes, named so that the test says what it checks
SPECS = 200
DEADLINE_S = 300  # a hang guard: ~40 s on an idle 2-core machine, several times that on a loaded one


@pytest.fixture(scope="module")
def grammar_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(tmp_path_factory.mktemp("grammar-memory"), "--grammar-cache-bytes", str(BOUND)) as server:
        yield server


def constrained(client: httpx.Client, regex: str) -> None:
    body = chat_body("Write the letter a, many times.", 1, structured_outputs={"regex": regex})
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


def test_distinct_heavy_grammars_stay_within_the_cache_bound(grammar_server: Server) -> None:
    pid = engine_pid(grammar_server)
    with httpx.Client(base_url=grammar_server.base_url, timeout=60) as client:
        for i in range(4):  # warm-up: the compiler's tokenizer and threads, a few small grammars
            constrained(client, rf"[0-9]{{{i + 1}}}-[a-z]+")
        baseline = rss_kib(pid) << 10
        peak = baseline
        start = time.monotonic()

        def send(i: int) -> None:
            constrained(client, f"((a{{100}}){{100}}){{3}}z<tag>x{i}")

        with ThreadPoolExecutor(4) as pool:  # a few at a time: one compiles while the others run
            for done, _ in enumerate(pool.map(send, range(SPECS))):
                if done % 5 == 0:
                    peak = max(peak, rss_kib(pid) << 10)
                assert time.monotonic() - start < DEADLINE_S, f"only {done} specs in {DEADLINE_S} s"
        elapsed = time.monotonic() - start
        peak = max(peak, rss_kib(pid) << 10)
    metrics = grammar_server.metrics()
    growth = peak - baseline
    print(f"\n{SPECS} heavy specs in {elapsed:.1f} s: engine RSS {baseline / 2**20:.0f} -> peak "
          f"{peak / 2**20:.0f} MiB (+{growth / 2**20:.0f} MiB, bound {BOUND >> 20} MiB); cache "
          f"{metrics['tokenline_grammar_cache_bytes'] / 2**20:.0f} MiB in "
          f"{metrics['tokenline_grammar_cache_entries']:.0f} grammars, "
          f"{metrics['tokenline_grammar_cache_evictions_total']:.0f} evicted")
    assert metrics["tokenline_grammar_compiles_total"] >= SPECS
    assert metrics["tokenline_grammar_cache_bytes"] <= BOUND
    assert metrics["tokenline_grammar_cache_evictions_total"] >= SPECS // 2  # ~23 fit at once
    assert growth <= 1.1 * BOUND, f"engine grew by {growth / 2**20:.0f} MiB"
