"""A command line copied from `vllm serve` starts a real tokenline server: the accepted flags with no
effect here are named in one start-up warning, both served names work through the official
`openai` client, and `--chat-template` replaces the model's template in the prompt it renders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, start_server
from tokenline.frontend.tokenizer import Tokenizer

# Jinja, in the SmolLM2 chat layout, with a marker the model's own template never writes.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\nCUSTOM {{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def vllm_style(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("vllm-cli")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    flags = (
        "--model", str(default_model_dir), "--served-model-name", "a", "b", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--seed", "0", "--disable-log-requests", "--uvicorn-log-level", "warning",
        "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "1", "--enforce-eager",
        "--enable-prefix-caching", "--enable-chunked-prefill", "--max-model-len", "2048",
        "--max-num-batched-tokens", "1024", "--trust-remote-code", "--chat-template", str(template),
    )
    with start_server(tmp, *flags) as server:
        yield server


def test_the_warning_names_every_flag_without_effect(vllm_style: Server) -> None:
    log = vllm_style.log()
    (line,) = [x for x in log.splitlines() if "vLLM flags accepted with no effect" in x]
    for flag in ("--gpu-memory-utilization 0.9", "--tensor-parallel-size 1", "--enforce-eager",
                 "--trust-remote-code"):
        assert flag in line
    for honoured in ("--seed", "--chat-template", "--enable-prefix-caching", "--served-model-name"):
        assert honoured not in line
    assert "Application startup complete" not in log  # uvicorn logs at warning only


def test_both_names_work_through_the_openai_client(vllm_style: Server) -> None:
    client = openai.OpenAI(base_url=vllm_style.api_url, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["a", "b"]
    assert client.models.retrieve("b").id == "b"
    for name in ("a", "b"):
        completion = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert completion.model == "a" and completion.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="c", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert "request_finished" not in vllm_style.log()  # --disable-log-requests


def test_chat_template_flag_replaces_the_models_template(vllm_style: Server, default_model_dir: Path) -> None:
    body = {"model": "b", "messages": [{"role": "user", "content": "hello there"}]}
    tokens = httpx.post(f"{vllm_style.base_url}/tokenize", json=body, timeout=30).json()["tokens"]
    text = httpx.post(f"{vllm_style.base_url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert text == "<|im_start|>user\nCUSTOM hello there<|im_end|>\n<|im_start|>assistant\n"
    own = Tokenizer.from_dir(default_model_dir).apply_chat_template(body["messages"])
    assert "CUSTOM" not in own and own != text  # the model's own template renders something else
