"""A server with vLLM's ``--speculative-config '{"method": "suffix", ...}'``, driven by the official
openai client: the same greedy text (streamed and not) as a server without speculation, its
/metrics count accepted drafts, and a bad suffix setting is refused before the model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from openai import OpenAI

from tests.e2e.conftest import Server, start_server

MODEL = "SmolLM2-135M-Instruct"
CODE = '''def area(width, height):
    """Area of a rectangle."""
    return width * height
'''
MESSAGES = [{"role": "user", "content": f"Repeat the following code exactly:\n\n{CODE}"}]


def chat(server: Server, stream: bool) -> str:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    if not stream:
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=48)
        return response.choices[0].message.content or ""
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=48, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_same_text_as_plain_and_drafts_accepted(tmp_path: Path, server: Server) -> None:
    expected = chat(server, stream=False)
    assert "width * height" in expected  # the model does copy the code
    config = '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32}'
    with start_server(tmp_path, "--speculative-config", config, "--dtype", "float32") as spec_server:
        assert chat(spec_server, stream=False) == expected
        assert chat(spec_server, stream=True) == expected
        metrics = spec_server.metrics()
    drafted = metrics["vllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafted
    # Copying: more than one token accepted per verified draft, on average.
    assert accepted > metrics["vllm:spec_decode_num_drafts_total"]


def test_bad_suffix_setting_is_refused_at_startup(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tokenline.cli", "serve", "--port", "0", "--speculative-config",
               '{"method": "suffix", "suffix_decoding_min_token_prob": 2}']
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    assert "suffix_decoding_min_token_prob must be in [0, 1]" in result.stderr
