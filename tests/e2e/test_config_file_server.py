"""A real server started from `--config FILE.yaml` (vLLM's form: flag names without dashes): the
file's settings hold, a flag on the command line overrides the file, through the official client."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.e2e.conftest import start_server

CAP = 8


def test_a_server_takes_its_settings_from_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(f"served-model-name: [from-file, alias]\nmax_tokens_cap: {CAP}\nenable-prefix-caching: false\n")
    with start_server(tmp_path, "--config", str(config), "--served-model-name", "from-flag") as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="none")
        assert [m.id for m in client.models.list().data] == ["from-flag"]  # the command line wins
        messages = [{"role": "user", "content": "Count from one to fifty in words, please."}]
        for _ in range(2):  # the same prompt twice: a prefix cache would serve the second from cache
            chat = client.chat.completions.create(model="from-flag", messages=messages, temperature=0)
            assert chat.usage.completion_tokens == CAP  # the file's cap on an omitted max_tokens
            assert chat.usage.prompt_tokens > 32  # two blocks and more: cacheable were caching on
            assert chat.usage.prompt_tokens_details.cached_tokens == 0  # the file turned prefix caching off
