"""vLLM's request fields that older clients and eval harnesses send, through a real server on the
default model and the official ``openai`` SDK (``extra_body``): guided_* (aliases of
structured_outputs), echo, prompt_logprobs, return_tokens_as_token_ids, truncate_prompt_tokens,
/tokenize's return_token_strs; and prompt logprobs equal to HF transformers' on the same model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.e2e.conftest import Server

MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-3  # nats
# Over 64 tokens, so the server prefills it as one long chunk (not the one-call layer's small steps).
STORY = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who had never once left the valley. Every morning he wound the clocks of the square, and every "
    "evening he walked to the river to watch the light fade over the water."
)
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def hf_logprobs(default_model_dir: Path) -> Any:
    """``score(ids)``: transformers' [len(ids), vocab] log-softmax at each position (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def score(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return score


def tokenize(server: Server, text: str, **fields: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text, **fields}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def complete(client: openai.OpenAI, prompt: str | list[int] = "The capital of France is", **kwargs: Any):  # noqa: ANN201
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 8)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any):  # noqa: ANN201
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 16)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


# --- guided_* ------------------------------------------------------------------------------


def test_guided_fields_constrain_the_output(client: openai.OpenAI) -> None:
    user = [{"role": "user", "content": "Pick a colour and a count."}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=user, max_tokens=40, temperature=0, extra_body={"guided_json": SCHEMA}
    )
    assert raw.headers["deprecation"] == "true" and "structured_outputs" in raw.headers["warning"]
    jsonschema.validate(json.loads(raw.parse().choices[0].message.content), SCHEMA)

    answer = chat(client, [{"role": "user", "content": "Is water wet?"}],
                  extra_body={"guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"})
    assert answer.choices[0].message.content in ("yes", "no")
    number = complete(client, "My phone number is", max_tokens=12, extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", number.choices[0].text)
    grammar = 'start: "The answer is " ("yes" | "no") "."'
    text = complete(client, "Q: Is fire cold?\nA:", max_tokens=12, extra_body={"guided_grammar": grammar})
    assert text.choices[0].text in ("The answer is yes.", "The answer is no.")
    plain = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert "deprecation" not in plain.headers


def test_guided_conflicts_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, extra_body={"guided_json": SCHEMA, "structured_outputs": {"regex": "a"}})
    assert info.value.response.json()["error"]["param"] == "guided_json"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, [{"role": "user", "content": "hi"}], response_format={"type": "json_object"},
             extra_body={"guided_regex": "a+"})
    assert info.value.response.json()["error"]["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, extra_body={"guided_regex": "(unclosed"})
    assert info.value.response.json()["error"]["param"] == "guided_regex"


# --- echo, prompt_logprobs, max_tokens 0 ---------------------------------------------------


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = complete(client, prompt, max_tokens=4)
    echoed = complete(client, prompt, max_tokens=4, echo=True, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    usage = echoed.usage
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text and logprobs.text_offset[0] == 0
    assert len(choice.model_extra["prompt_logprobs"]) == usage.prompt_tokens  # vLLM returns them too
    without_logprobs = complete(client, prompt, max_tokens=4, echo=True)
    assert without_logprobs.choices[0].text == choice.text and without_logprobs.choices[0].logprobs is None


def test_echo_with_max_tokens_zero_scores_the_prompt_like_transformers(
    client: openai.OpenAI, server: Server, hf_logprobs: Any
) -> None:
    """lm-evaluation-harness's log-likelihood request: the prompt's logprobs, nothing generated."""
    ids = tokenize(server, STORY, add_special_tokens=False)["tokens"]
    response = complete(client, STORY, max_tokens=0, echo=True, logprobs=2)
    choice = response.choices[0]
    assert choice.text == STORY and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(ids)
    reference = hf_logprobs(ids)
    values = choice.logprobs.token_logprobs
    assert len(values) == len(ids) and values[0] is None
    worst = max(abs(values[i] - reference[i - 1, ids[i]].item()) for i in range(1, len(ids)))
    assert worst < TOLERANCE
    for i in range(1, len(ids)):  # the top alternatives too (two, as logprobs asked)
        assert len(choice.logprobs.top_logprobs[i]) <= 2
        assert max(choice.logprobs.top_logprobs[i].values()) == pytest.approx(reference[i - 1].max().item(), abs=TOLERANCE)

    stream = complete(client, STORY, max_tokens=0, echo=True, logprobs=0, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == STORY
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(values[1:], abs=1e-6)


def test_prompt_logprobs_match_transformers_after_a_prefix_cache_hit(
    client: openai.OpenAI, server: Server, hf_logprobs: Any
) -> None:
    ids = tokenize(server, STORY + " The end.", add_special_tokens=False)["tokens"]
    complete(client, ids, max_tokens=1)  # leaves the prompt's blocks in the prefix cache
    warm = complete(client, ids, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    # A prompt-logprobs request recomputes every position (as vLLM) rather than skip the cached ones.
    scored = complete(client, ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    entries = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    reference = hf_logprobs(ids)
    for position in range(1, len(ids)):
        entry = entries[position]
        own = entry[str(ids[position])]
        row = reference[position - 1]
        assert abs(own["logprob"] - row[ids[position]].item()) < TOLERANCE
        assert own["rank"] == int((row >= row[ids[position]]).sum())
        assert own["decoded_token"] == httpx.post(f"{server.base_url}/detokenize", json={"tokens": [ids[position]]},
                                                  timeout=30).json()["prompt"] or position > 3
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(ids[position]))
        assert ranks in ([1, 2], [1], [2])  # the top 2, less the prompt's own token where it is one
    assert scored.choices[0].text == warm.choices[0].text


def test_chat_echo_and_prompt_logprobs(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    answer = chat(client, messages, max_tokens=6, extra_body=extra)
    continued = chat(client, messages, max_tokens=6, extra_body={**extra, "echo": False})
    assert answer.choices[0].message.content == "Once upon a" + continued.choices[0].message.content
    stream = chat(client, messages, max_tokens=6, stream=True, extra_body=extra)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert deltas[1] == "Once upon a" and "".join(deltas) == answer.choices[0].message.content
    # After a user turn the answer is the assistant's: nothing of the user's is echoed.
    user = [{"role": "user", "content": "Say hello."}]
    assert chat(client, user, max_tokens=4, extra_body={"echo": True}).choices[0].message.content == \
        chat(client, user, max_tokens=4).choices[0].message.content

    scored = chat(client, user, max_tokens=2, extra_body={"prompt_logprobs": 1})
    entries = scored.model_extra["prompt_logprobs"]
    assert len(entries) == scored.usage.prompt_tokens and entries[0] is None
    assert all(1 <= len(e) <= 2 and all(v["logprob"] <= 0 for v in e.values()) for e in entries[1:])
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, user, stream=True, extra_body={"prompt_logprobs": 1})
    assert info.value.response.json()["error"]["param"] == "prompt_logprobs"


def test_return_tokens_as_token_ids_on_chat(client: openai.OpenAI, server: Server) -> None:
    user = [{"role": "user", "content": "Name a fruit."}]
    answer = chat(client, user, max_tokens=5, logprobs=True, top_logprobs=2,
                  extra_body={"return_tokens_as_token_ids": True})
    content = answer.choices[0].logprobs.content
    ids = [int(re.fullmatch(r"token_id:(\d+)", entry.token).group(1)) for entry in content]
    assert all(re.fullmatch(r"token_id:\d+", top.token) for entry in content for top in entry.top_logprobs)
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text.startswith(answer.choices[0].message.content)
    assert b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace") == text  # bytes stay the token's


# --- truncate_prompt_tokens, return_token_strs ---------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI, server: Server) -> None:
    ids = tokenize(server, STORY, add_special_tokens=False)["tokens"]
    cut = complete(client, STORY, max_tokens=3, echo=True, extra_body={"truncate_prompt_tokens": 5})
    assert cut.usage.prompt_tokens == 5
    tail = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids[-5:]}, timeout=30).json()["prompt"]
    assert cut.choices[0].text.startswith(tail)
    assert complete(client, ids[-5:], max_tokens=3).choices[0].text == cut.choices[0].text[len(tail):]
    assert complete(client, STORY, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}).usage.prompt_tokens == \
        len(ids)
    messages = [{"role": "user", "content": STORY}]
    assert chat(client, messages, max_tokens=1, extra_body={"truncate_prompt_tokens": 7}).usage.prompt_tokens == 7
    for bad in (0, 10**6):
        with pytest.raises(openai.BadRequestError) as info:
            complete(client, extra_body={"truncate_prompt_tokens": bad})
        assert info.value.response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_tokenize_returns_token_strings(server: Server, default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    body = tokenize(server, "Hello world, naïve café", add_special_tokens=False, return_token_strs=True)
    reference = AutoTokenizer.from_pretrained(default_model_dir)
    assert body["token_strs"] == reference.convert_ids_to_tokens(body["tokens"])
    assert body["token_strs"][:2] == ["Hello", "Ġworld"]
    assert "token_strs" not in tokenize(server, "Hello")
    chat_body = httpx.post(f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "return_token_strs": True}, timeout=30).json()
    assert len(chat_body["token_strs"]) == chat_body["count"] and "<|im_start|>" in chat_body["token_strs"]
