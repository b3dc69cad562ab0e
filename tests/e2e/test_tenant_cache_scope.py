"""Whose cached work a request may reuse, through a real server with keyed tenants: prompt
prefixes and compiled grammars, whose hits show in ``cached_tokens`` and in the time to the first
token.

By default (``--prefix-cache-scope tenant``) Bob sending Alice's exact memo gets the
``cached_tokens`` a wrong guess of his gets: only what he cached himself (his own chat-template
prefix). Alice re-sending it gets the hit. The caller's ``cache_salt`` (vLLM's field) splits a
tenant's cache further, on chat, completions and Responses alike. With ``--prefix-cache-scope
global`` every tenant shares the cache, and Bob gets Alice's hit: the setting's documented risk.
Compiled grammars are always kept per tenant: Bob's first request with Alice's spec compiles it
again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, start_server
from tokenline.gateway.keys import hash_key

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"alice": "tl-scope-alice", "bob": "tl-scope-bob", "ops": "tl-scope-ops"}
# About 160 tokens with the chat template: 9 full blocks of 16 before the last token, most of them
# Alice's own text.
MEMO = ("Internal memo from Alice, finance: the Q3 acquisition of Northwind Traders closes on October 14 at "
        "a price of 41.7 million euros, financed by a bridge loan from Castellane Bank at 5.2 percent. The "
        "board has not been told; legal counsel Marguerite Osei drafts the disclosure by the end of "
        "September. Payroll for the Lisbon office moves to the new provider in November, and the audit of "
        "the Rotterdam warehouse is postponed to January because the inventory system migration slipped. "
        "Do not forward this memo; reply only to confirm that you have read it and understood every point.")
# A wrong guess, different from its first word on: what it hits is what any prompt of Bob's hits.
GUESS = MEMO.replace("Internal memo from Alice", "Draft note by Bob", 1).replace("Northwind", "Contoso")


def keys_file(tmp: Path) -> Path:
    path = tmp / "keys.toml"
    path.write_text("".join(f'[[tenant]]\nname = "{name}"\nkey_sha256 = "{hash_key(key)}"\n'
                            f'admin = {str(name == "ops").lower()}\n\n' for name, key in KEYS.items()))
    return path


def client(server: Server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=KEYS[tenant], max_retries=0, timeout=120)


def cached(server: Server, tenant: str, text: str, **extra: Any) -> int:
    reply = client(server, tenant).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1, temperature=0,
        extra_body=extra or None)
    details = reply.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


@pytest.fixture(scope="module")
def scoped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("prefix-scope")
    with start_server(tmp, "--keys", str(keys_file(tmp))) as server:
        yield server


def test_another_tenants_exact_prompt_is_no_hit(scoped: Server) -> None:
    assert cached(scoped, "alice", MEMO) == 0
    cached(scoped, "bob", "Something of Bob's own, to cache his template prefix.")
    wrong_guess = cached(scoped, "bob", GUESS)
    exact_guess = cached(scoped, "bob", MEMO)
    assert exact_guess == wrong_guess < 32, (exact_guess, wrong_guess)  # his own template prefix only
    assert cached(scoped, "alice", MEMO) >= 128  # Alice herself still hits her memo


def test_cache_salt_splits_a_tenants_cache_on_every_route(scoped: Server) -> None:
    text = MEMO.replace("Alice", "Alicia")
    assert cached(scoped, "alice", text, cache_salt="project-1") == 0
    assert cached(scoped, "alice", text, cache_salt="project-2") < 32  # another salt: a miss
    assert cached(scoped, "alice", text) < 32  # no salt: a miss too
    assert cached(scoped, "alice", text, cache_salt="project-1") >= 128
    # The field is vLLM's on completions and accepted on Responses too.
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    for path, body in (("completions", {"prompt": text, "max_tokens": 1}),
                       ("responses", {"input": text, "max_output_tokens": 1})):
        response = httpx.post(f"{scoped.api_url}/{path}", headers=headers, timeout=120,
                              json={"model": MODEL, "cache_salt": "project-3", **body})
        assert response.status_code == 200, response.text
    refused = httpx.post(f"{scoped.api_url}/chat/completions", headers=headers, timeout=60,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": 7})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt", refused.text


def test_grammars_are_compiled_per_tenant(scoped: Server) -> None:
    spec = {"structured_outputs": {"regex": "((a{100}){100}){3}z"}}  # ~0.1 s to compile
    compiles = scoped.metrics(KEYS["ops"])["tokenline_grammar_compiles_total"]
    cached(scoped, "alice", "Count", **spec)
    cached(scoped, "alice", "Count again", **spec)  # Alice's second request: her grammar, a hit
    assert scoped.metrics(KEYS["ops"])["tokenline_grammar_compiles_total"] == compiles + 1
    cached(scoped, "bob", "Count", **spec)  # the same spec from Bob: compiled for him
    metrics = scoped.metrics(KEYS["ops"])
    assert metrics["tokenline_grammar_compiles_total"] == compiles + 2
    assert metrics["tokenline_grammar_cache_entries"] >= 2


def test_global_scope_shares_the_cache_between_tenants(tmp_path: Path) -> None:
    with start_server(tmp_path, "--keys", str(keys_file(tmp_path)), "--prefix-cache-scope", "global") as server:
        assert cached(server, "alice", MEMO) == 0
        assert cached(server, "bob", MEMO) >= 128  # what the default scope prevents
        assert cached(server, "bob", MEMO, cache_salt="bob-only") < 32  # a salt still splits it
