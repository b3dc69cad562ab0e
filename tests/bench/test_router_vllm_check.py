"""bench/router_vllm_check.py without vLLM (CI has none): it imports, and with no vLLM venv it says
how to install one and exits 2 before starting anything. The real run is documented in
docs/operate/fleet.md ("A real vLLM behind the router")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "router_vllm_check.py"


def test_without_a_vllm_venv_it_says_how_to_get_one_and_starts_nothing(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--vllm-venv", str(tmp_path / "none"),
                             "--logs", str(tmp_path / "logs")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "install_vllm.sh" in result.stderr
    assert not (tmp_path / "logs").exists()  # nothing was launched
