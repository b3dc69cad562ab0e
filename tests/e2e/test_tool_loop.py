"""The default model (SmolLM2, whose template prints ``message['content']`` as is) serves an agent's
tool loop past turn 1: ``content: null`` and missing ``content`` on tool-calling turns, tool results
as text parts. The tiny Qwen3.5 model runs the same check in test_hybrid_server.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Server, start_server
from tests.e2e.tool_loop import check_tool_loop

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    with start_server(tmp_path_factory.mktemp("tool-loop"), "--tool-call-parser", "hermes",
                      "--served-model-name", "smol") as server:
        yield server


def test_an_agent_tool_loop_renders_and_tokenizes_alike(hermes: Server) -> None:
    check_tool_loop(hermes, "smol")
