"""`tokenline plan` for a Gemma-3-27B-shaped config: sliding-window layers hold their window's
blocks, and the plan shows that beside the same config with every layer global."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenline.cli import main
from tokenline.model.config import ModelConfig
from tokenline.model.plan import plan_memory
from tokenline.model.registry import resolve_architecture

# google/gemma-3-27b's text config: 62 layers, every 6th global, the others a 1,024-token window;
# 16 KV heads x 128 dims. Served as Gemma3ForCausalLM where the registry has it, else as the same
# attention layout on the Qwen3 trunk (the KV figures depend on layers, heads and window only).
CONFIG = {
    "architectures": [resolve_architecture(["Gemma3ForCausalLM", "Qwen3ForCausalLM"])],
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "use_sliding_window": True,
    "vocab_size": 262208,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}
PER_LAYER_TOKEN = 2 * 16 * 128 * 2  # K and V x 16 heads x 128 dims x 2 B (bfloat16) = 8,192 B
FULL, SLIDING = 10, 52  # layers 5, 11, ..., 59 are global
BLOCK = 16
HELD = (1024 // BLOCK + 1) * BLOCK  # a sliding layer's most: its window's blocks at the worst alignment


@pytest.mark.parametrize("seq_len", [4096, 32768])
def test_the_window_saves_what_the_layers_do_not_see(seq_len: int) -> None:
    config = ModelConfig.from_dict(CONFIG)
    assert config.num_sliding_attention_layers == SLIDING and config.sliding_window == 1024
    plan = plan_memory(config, memory_gib=80, seq_len=seq_len, block_size=BLOCK)
    all_global = 62 * PER_LAYER_TOKEN * seq_len
    held = FULL * PER_LAYER_TOKEN * seq_len + SLIDING * PER_LAYER_TOKEN * HELD
    assert plan.kv_bytes_per_sequence_all_global == all_global
    assert plan.kv_bytes_per_sequence == held == plan.bytes_per_sequence
    # The target (5 of 6 layers at window / seq_len, plus one block per layer).
    assert held <= (1 / 6 + 5 / 6 * 1024 / seq_len) * all_global + 62 * BLOCK * PER_LAYER_TOKEN
    assert plan.max_sequences == plan.cache_budget_bytes // held


def test_the_cli_prints_both_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert main(["plan", "--model", str(path), "--memory", "80", "--seq-len", "32768"]) == 0
    out = capsys.readouterr().out
    assert "sliding layers holding 1,040 tokens" in out
    assert "with every layer global" in out and "15.50 GiB" in out  # 62 x 8,192 B x 32,768
