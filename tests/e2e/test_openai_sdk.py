"""The official `openai` SDK (sync and async) against a real tokenline server on the default model.

Every request is small (a few dozen tokens at most) so the module stays quick on a 2-core CPU.
Greedy means temperature 0. The session `server` fixture is shared; one extra server (API key +
another served model name) is started for the auth and model-name checks.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, start_server

MODEL = "SmolLM2-135M-Instruct"
SHORT_ANSWER = [{"role": "user", "content": "Is the sky blue? Answer with one word."}]
COLOURS = [{"role": "user", "content": "Name three colours."}]
FRANCE_PROMPT = "The capital of France is"
GREEDY_CHAT_TOKENS = 24  # the default max_tokens of `chat()`
GREEDY_COMPLETION_TOKENS = 16  # the default max_tokens of `complete()`

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=120) as sdk:
        yield sdk


def chat(client: openai.OpenAI, messages: list[dict[str, Any]] = COLOURS, **kwargs: Any):  # noqa: ANN201
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", GREEDY_CHAT_TOKENS)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def complete(client: openai.OpenAI, prompt: str = FRANCE_PROMPT, **kwargs: Any):  # noqa: ANN201
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", GREEDY_COMPLETION_TOKENS)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


@pytest.fixture(scope="module")
def greedy_chat(client: openai.OpenAI):  # noqa: ANN201
    """The greedy answer to COLOURS with the default max_tokens, computed once for the module."""
    return chat(client)


@pytest.fixture(scope="module")
def greedy_completion(client: openai.OpenAI):  # noqa: ANN201
    return complete(client)


def check_usage(usage: Any, completion_tokens: int | None = None) -> None:
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens >= 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens


# --- plain chat and completions -----------------------------------------------------------------


def test_chat_completion(client: openai.OpenAI, greedy_chat: Any) -> None:
    first = greedy_chat
    assert first.object == "chat.completion"
    assert first.model == MODEL
    assert first.id.startswith("chatcmpl-")
    assert len(first.choices) == 1
    choice = first.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    check_usage(first.usage)
    if choice.finish_reason == "length":
        assert first.usage.completion_tokens == GREEDY_CHAT_TOKENS
    second = chat(client)
    assert second.choices[0].message.content == choice.message.content  # greedy is deterministic
    assert second.choices[0].finish_reason == choice.finish_reason
    assert second.usage.completion_tokens == first.usage.completion_tokens
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.id != first.id


def test_text_completion(client: openai.OpenAI, greedy_completion: Any) -> None:
    first = greedy_completion
    assert first.object == "text_completion"
    assert first.model == MODEL
    assert len(first.choices) == 1
    assert first.choices[0].text.strip()
    assert first.choices[0].finish_reason in ("stop", "length")
    check_usage(first.usage)
    second = complete(client)
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.completion_tokens == first.usage.completion_tokens


def test_prefix_caching_reports_cached_tokens(client: openai.OpenAI) -> None:
    # A prompt several KV blocks long (block size 16) that no other test uses.
    long_text = " ".join(f"Item {i} is a sea creature called the number {i} shell." for i in range(25))
    messages = [{"role": "system", "content": long_text}, {"role": "user", "content": "Which item is first?"}]
    first = chat(client, messages, max_tokens=4)
    assert first.usage.prompt_tokens > 100
    second = chat(client, messages, max_tokens=4)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert cached >= first.usage.prompt_tokens - 32  # all full blocks but (at most) the last ones
    assert cached < second.usage.prompt_tokens  # at least one token is always computed


# --- streaming --------------------------------------------------------------------------------


def test_stream_chat_matches_non_streamed(client: openai.OpenAI, greedy_chat: Any) -> None:
    full = greedy_chat
    stream = chat(client, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks, "no chunks"
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)

    first_choice_chunk = next(c for c in chunks if c.choices)
    assert first_choice_chunk.choices[0].delta.role == "assistant"

    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    check_usage(usage_chunk.usage, full.usage.completion_tokens)
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])

    body = chunks[:-1]
    assert all(len(c.choices) == 1 and c.choices[0].index == 0 for c in body)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == full.choices[0].message.content
    finishes = [i for i, c in enumerate(body) if c.choices[0].finish_reason is not None]
    assert finishes == [len(body) - 1]
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stream_chat_without_usage_option(client: openai.OpenAI) -> None:
    chunks = list(chat(client, stream=True, max_tokens=8))
    assert chunks and all(c.choices for c in chunks)  # no usage chunk unless asked for
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_completion_matches_non_streamed(client: openai.OpenAI, greedy_completion: Any) -> None:
    full = greedy_completion
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    check_usage(usage_chunk.usage, full.usage.completion_tokens)
    body = chunks[:-1]
    assert all(len(c.choices) == 1 and c.choices[0].index == 0 for c in body)
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    finishes = [i for i, c in enumerate(body) if c.choices[0].finish_reason is not None]
    assert finishes == [len(body) - 1]
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stream_n3_per_choice_finish_and_matches_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(n=3, temperature=1.0, seed=4242, max_tokens=8)
    full = chat(client, **kwargs)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts: dict[int, str] = defaultdict(str)
    events: dict[int, list[str | None]] = defaultdict(list)
    roles: dict[int, list[str | None]] = defaultdict(list)
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            events[ch.index].append(ch.finish_reason)
            roles[ch.index].append(ch.delta.role)
    assert sorted(texts) == [0, 1, 2]
    for i in range(3):
        assert roles[i][0] == "assistant"
        assert [f for f in events[i] if f is not None] == [full.choices[i].finish_reason]
        assert events[i][-1] is not None  # the finish chunk is the last one of its choice
        assert texts[i] == full.choices[i].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


# --- async client, continuous batching ------------------------------------------------------------

ASYNC_QUESTIONS = [
    "What is 2 + 2?",
    "Name a fruit.",
    "What colour is grass?",
    "Say hello in French.",
    "What is the capital of Italy?",
    "Name a planet.",
    "How many legs does a cat have?",
    "What is water made of?",
]


def test_async_concurrent_greedy_matches_sequential(server: Server) -> None:
    max_tokens = 10

    async def run() -> tuple[list[Any], list[Any]]:
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=120) as aclient:

            async def ask(question: str) -> Any:
                return await aclient.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": question}],
                    temperature=0,
                    max_tokens=max_tokens,
                )

            sequential = [await ask(q) for q in ASYNC_QUESTIONS]
            concurrent = await asyncio.gather(*(ask(q) for q in ASYNC_QUESTIONS))
            return sequential, list(concurrent)

    sequential, concurrent = asyncio.run(run())
    assert len(concurrent) == 8
    mismatches = []
    for question, alone, batched in zip(ASYNC_QUESTIONS, sequential, concurrent):
        assert batched.choices[0].message.content
        check_usage(batched.usage)
        assert batched.usage.prompt_tokens == alone.usage.prompt_tokens
        a, b = alone.choices[0].message.content, batched.choices[0].message.content
        if a != b:
            mismatches.append((question, a, b))
    # Batching changes the shapes of bfloat16 matmuls, so a rare near-tie between the top two tokens
    # may flip late in a sequence; at most one of eight may diverge, and only after a shared prefix.
    assert len(mismatches) <= 1, mismatches
    for _question, a, b in mismatches:
        common = len(_common_prefix(a, b))
        assert common >= min(len(a), len(b)) // 2, (a, b)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


# --- sampling: n, seed ----------------------------------------------------------------------------


def test_n3_seeded_sampling(client: openai.OpenAI) -> None:
    kwargs = dict(n=3, temperature=1.0, max_tokens=8)
    a = chat(client, seed=1234, **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert all(c.message.content is not None for c in a.choices)
    assert 3 <= a.usage.completion_tokens <= 3 * 8  # counted over all three choices
    b = chat(client, seed=1234, **kwargs)
    assert [c.message.content for c in b.choices] == [c.message.content for c in a.choices]
    assert b.usage.completion_tokens == a.usage.completion_tokens
    other = chat(client, seed=987654, **kwargs)
    assert [c.message.content for c in other.choices] != [c.message.content for c in a.choices]
    # Three samples at temperature 1 of an 8-token answer: not all the same.
    assert len({c.message.content for c in a.choices}) > 1


def test_seed_reproducible_n1(client: openai.OpenAI) -> None:
    kwargs = dict(temperature=1.0, max_tokens=10)
    a = complete(client, "Once upon a time", seed=77, **kwargs)
    b = complete(client, "Once upon a time", seed=77, **kwargs)
    assert a.choices[0].text == b.choices[0].text
    other = complete(client, "Once upon a time", seed=123457, **kwargs)
    assert other.choices[0].text != a.choices[0].text  # 10 tokens at temperature 1: a tie is unlikely


# --- logprobs --------------------------------------------------------------------------------------


def test_chat_logprobs(client: openai.OpenAI, greedy_chat: Any) -> None:
    response = chat(client, logprobs=True, top_logprobs=3, max_tokens=8)
    assert greedy_chat.choices[0].message.content.startswith(response.choices[0].message.content)
    content = response.choices[0].logprobs.content
    assert content is not None
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        # Greedy picks the most likely token.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    joined = "".join(e.token for e in content)
    assert joined.startswith(response.choices[0].message.content) or response.choices[0].message.content.startswith(
        joined.rstrip()
    )


def test_chat_logprobs_streamed(client: openai.OpenAI) -> None:
    full = chat(client, logprobs=True, top_logprobs=2, max_tokens=6)
    tokens = []
    for chunk in chat(client, logprobs=True, top_logprobs=2, max_tokens=6, stream=True):
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                tokens.extend((t.token, round(t.logprob, 3)) for t in ch.logprobs.content)
    assert tokens == [(t.token, round(t.logprob, 3)) for t in full.choices[0].logprobs.content]


def test_completion_logprobs(client: openai.OpenAI, greedy_completion: Any) -> None:
    response = complete(client, logprobs=2, max_tokens=8)
    assert greedy_completion.choices[0].text.startswith(response.choices[0].text)
    choice = response.choices[0]
    lp = choice.logprobs
    assert lp is not None
    n = response.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the chosen one is the best
        assert token in top
    assert lp.text_offset[0] == 0
    for i in range(1, n):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    assert "".join(lp.tokens) == choice.text


# --- stop strings and vLLM extensions ----------------------------------------------------------------


def _stop_word(text: str) -> str:
    """A word from the middle of a greedy answer: surely generated again, not at its start."""
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert len(words) >= 3, text
    return words[len(words) // 2]


def test_stop_strings(client: openai.OpenAI, greedy_chat: Any) -> None:
    full = greedy_chat.choices[0].message.content
    stop = _stop_word(full)
    cut = full.index(stop)
    response = chat(client, stop=[stop, "ZZZ-never"])
    assert response.choices[0].message.content == full[:cut]
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < greedy_chat.usage.completion_tokens

    kept = chat(client, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == full[: cut + len(stop)]
    assert kept.choices[0].finish_reason == "stop"

    streamed = chat(client, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[:cut]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_stop_string_on_completions(client: openai.OpenAI, greedy_completion: Any) -> None:
    full = greedy_completion.choices[0].text
    stop = _stop_word(full)
    cut = full.index(stop)
    response = complete(client, stop=stop)
    assert response.choices[0].text == full[:cut]
    assert response.choices[0].finish_reason == "stop"


def test_ignore_eos_and_min_tokens(client: openai.OpenAI) -> None:
    short = chat(client, SHORT_ANSWER, max_tokens=40)
    assert short.choices[0].finish_reason == "stop"
    natural = short.usage.completion_tokens
    assert natural < 10, short.choices[0].message.content

    forced = chat(client, SHORT_ANSWER, max_tokens=40, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 40
    assert forced.choices[0].finish_reason == "length"

    at_least = chat(client, SHORT_ANSWER, max_tokens=40, extra_body={"min_tokens": 10})
    assert at_least.usage.completion_tokens >= 10
    assert at_least.choices[0].message.content.startswith(short.choices[0].message.content.rstrip()[:1])


def test_top_k_min_p_repetition_penalty(client: openai.OpenAI, greedy_chat: Any) -> None:
    greedy = greedy_chat.choices[0].message.content
    # top_k=1 and min_p=1 both leave only the most likely token: sampling at temperature 1 is greedy.
    top1 = chat(client, max_tokens=8, temperature=1.0, seed=3, extra_body={"top_k": 1})
    assert top1.usage.completion_tokens == 8
    assert greedy.startswith(top1.choices[0].message.content)
    minp = chat(client, max_tokens=8, temperature=1.0, seed=3, extra_body={"min_p": 1.0})
    assert minp.choices[0].message.content == top1.choices[0].message.content
    # A strong penalty changes a greedy answer that repeats tokens.
    prompt = [{"role": "user", "content": "Write the word 'cat' five times, separated by commas."}]
    plain = chat(client, prompt, max_tokens=12).choices[0].message.content
    penalised = chat(client, prompt, max_tokens=12, extra_body={"repetition_penalty": 3.0}).choices[0].message.content
    assert penalised != plain, plain


def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = chat(client, max_tokens=20, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = chat(client, max_tokens=3, max_completion_tokens=6)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    c = complete(client, max_tokens=4)
    assert c.usage.completion_tokens == 4 and c.choices[0].finish_reason == "length"


def test_multi_turn_with_sdk_message_object(client: openai.OpenAI) -> None:
    first = chat(client, max_tokens=4)
    history = [*COLOURS, first.choices[0].message, {"role": "user", "content": "And one more?"}]
    second = chat(client, history, max_tokens=3, user="e2e", metadata={"suite": "e2e"}, store=False)
    assert second.usage.completion_tokens == 3
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_completion_batch_of_prompts_with_n(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt=[FRANCE_PROMPT, "One, two, three,"], n=2, temperature=0, max_tokens=3
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    texts = [c.text for c in response.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: both choices of a prompt agree
    assert texts[0] != texts[2]
    assert response.usage.completion_tokens == 12
    single = complete(client, max_tokens=3)
    assert response.usage.prompt_tokens > single.usage.prompt_tokens  # each prompt counted once
    assert texts[0] == single.choices[0].text


def test_errors_through_the_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=10**6)
    assert info.value.code == "context_length_exceeded"
    assert info.value.response.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_completion_tokens=10**6)
    assert info.value.response.json()["error"]["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, suffix="the end", max_tokens=2)
    assert info.value.response.json()["error"]["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=2, extra_body={"no_such_field": 1})
    assert "no_such_field" in info.value.message
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=2, top_logprobs=2)  # without logprobs=True
    response = chat(client, max_tokens=3, logprobs=True, top_logprobs=0)
    assert all(entry.top_logprobs == [] for entry in response.choices[0].logprobs.content)


# --- non-generation routes ----------------------------------------------------------------------------


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL]
    assert models.data[0].object == "model"
    assert models.data[0].owned_by


def test_health_version_tokenize_detokenize(server: Server, client: openai.OpenAI) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        version = http.get("/version")
        assert version.status_code == 200 and version.json()["version"]

        text = "Hello, tokenline! 1 + 1 = 2."
        tok = http.post("/tokenize", json={"model": MODEL, "prompt": text})
        assert tok.status_code == 200, tok.text
        body = tok.json()
        assert body["count"] == len(body["tokens"]) > 0
        assert body["max_model_len"] > 0
        detok = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
        assert detok.status_code == 200, detok.text
        assert detok.json()["prompt"] == text

        chat_tok = http.post("/tokenize", json={"model": MODEL, "messages": COLOURS})
        assert chat_tok.status_code == 200, chat_tok.text
        chat_ids = chat_tok.json()["tokens"]
        response = chat(client, max_tokens=1)
        assert len(chat_ids) == response.usage.prompt_tokens
        rendered = http.post("/detokenize", json={"tokens": chat_ids}).json()["prompt"]
        assert "Name three colours." in rendered and "assistant" in rendered

        prompt_ids = http.post("/tokenize", json={"prompt": FRANCE_PROMPT}).json()["tokens"]
        assert len(prompt_ids) == complete(client, max_tokens=1).usage.prompt_tokens

        bad = http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_request_id_header(server: Server, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=COLOURS, temperature=0, max_tokens=2, extra_headers={"X-Request-Id": "my-req.42:a_b"}
    )
    assert raw.headers["x-request-id"] == "my-req.42:a_b"
    assert raw.parse().choices[0].message.content is not None

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        echoed = http.get("/health", headers={"X-Request-Id": "abc 123<script>/\\;x"})
        assert echoed.headers["x-request-id"] == "abc123scriptx"
        generated = http.get("/health")
        assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])
        other = http.get("/health")
        assert other.headers["x-request-id"] != generated.headers["x-request-id"]
        only_unsafe = http.get("/version", headers={"X-Request-Id": "<>!!"})
        assert re.fullmatch(r"[0-9a-f]{32}", only_unsafe.headers["x-request-id"])
        long = http.get("/version", headers={"X-Request-Id": "a" * 500})
        assert long.headers["x-request-id"] == "a" * 128
        streamed = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": FRANCE_PROMPT, "max_tokens": 2, "stream": True},
            headers={"X-Request-Id": "stream-1"},
        )
        assert streamed.headers["x-request-id"] == "stream-1"
        error = http.post("/v1/chat/completions", json={"model": MODEL}, headers={"X-Request-Id": "err-1"})
        assert error.status_code == 400 and error.headers["x-request-id"] == "err-1"


# --- a second server: API key (from vLLM's VLLM_API_KEY variable) and another served model name ----


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    # The key comes from the environment, as vLLM reads it; --api-key is what other servers here use.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_API_KEY", "secret")  # start_server hands the environment on
        with start_server(tmp_path_factory.mktemp("keyed"), "--served-model-name", "other") as running:
            yield running


def test_api_key(keyed_server: Server) -> None:
    with openai.OpenAI(base_url=keyed_server.api_url, api_key="secret", max_retries=0, timeout=120) as good:
        response = good.chat.completions.create(
            model="other", messages=COLOURS, temperature=0, max_tokens=3
        )
        assert response.choices[0].message.content
        assert response.model == "other"
        assert [m.id for m in good.models.list().data] == ["other"]

    with openai.OpenAI(base_url=keyed_server.api_url, api_key="wrong", max_retries=0, timeout=30) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.chat.completions.create(model="other", messages=COLOURS, max_tokens=3)
        assert info.value.status_code == 401
        error = info.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "authentication_error"
        assert error["message"]
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()

    with httpx.Client(base_url=keyed_server.base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        missing = http.post("/v1/completions", json={"model": "other", "prompt": "Hi", "max_tokens": 1})
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        not_bearer = http.get("/v1/models", headers={"Authorization": "secret"})
        assert not_bearer.status_code == 401


def test_api_key_rejection_carries_request_id(keyed_server: Server) -> None:
    with httpx.Client(base_url=keyed_server.base_url, timeout=30) as http:
        rejected = http.get("/v1/models", headers={"X-Request-Id": "auth-1", "Authorization": "Bearer wrong"})
        assert rejected.status_code == 401
        assert rejected.headers.get("x-request-id") == "auth-1"


def test_served_model_name(keyed_server: Server) -> None:
    with openai.OpenAI(base_url=keyed_server.api_url, api_key="secret", max_retries=0, timeout=120) as sdk:
        with pytest.raises(openai.NotFoundError) as info:
            sdk.chat.completions.create(model=MODEL, messages=COLOURS, max_tokens=3)
        assert info.value.status_code == 404
        assert info.value.code == "model_not_found"
        assert info.value.response.json()["error"]["param"] == "model"
        with pytest.raises(openai.NotFoundError):
            sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        ok = sdk.completions.create(model="other", prompt=FRANCE_PROMPT, max_tokens=2, temperature=0)
        assert ok.model == "other" and ok.usage.completion_tokens == 2
