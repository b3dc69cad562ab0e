"""`tokenline plan` against a hand calculation for a Qwen3.5-27B-shaped hybrid config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenline.cli import main
from tokenline.model.config import ModelConfig
from tokenline.model.plan import plan_memory

# 64 layers: 48 Gated DeltaNet + 16 gated full attention (every 4th), as Qwen3.5-27B lays them out.
CONFIG_27B = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 248320,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "attn_output_gate": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
}

# By hand, bfloat16 (2 bytes), recurrent state in float32 (4 bytes):
KV_PER_TOKEN = 2 * 16 * 4 * 256 * 2  # K and V x 16 full layers x 4 KV heads x 256 dims x 2 B = 65,536
CONV_DIM = 2 * 16 * 128 + 48 * 128  # q and k (16 heads x 128) + v (48 heads x 128) = 10,240
STATE_PER_LAYER = CONV_DIM * (4 - 1) * 2 + 48 * 128 * 128 * 4  # conv window + delta-rule state
STATE_PER_SEQUENCE = 48 * STATE_PER_LAYER  # 153,944,064 B
EMBEDDINGS = 2 * 248320 * 5120  # untied input and output embeddings
FULL_LAYER = 5120 * 24 * 256 * 2 + 2 * 5120 * 4 * 256 + 24 * 256 * 5120 + 2 * 256  # gated q, k, v, o, q/k norms
LINEAR_LAYER = 5120 * (2 * 2048 + 2 * 6144) + 5120 * 2 * 48 + CONV_DIM * 4 + 48 + 48 + 128 + 6144 * 5120
DENSE_PER_LAYER = 3 * 5120 * 17408 + 2 * 5120  # SwiGLU MLP + two norms
PARAMETERS = EMBEDDINGS + 16 * FULL_LAYER + 48 * LINEAR_LAYER + 64 * DENSE_PER_LAYER + 5120


def test_plan_matches_the_hand_calculation() -> None:
    config = ModelConfig.from_dict(CONFIG_27B)
    plan = plan_memory(config, memory_gib=80, seq_len=8192, dtype_size=2)
    assert plan.kv_bytes_per_token == KV_PER_TOKEN == 65_536
    assert plan.state_bytes_per_sequence == STATE_PER_SEQUENCE == 153_944_064
    assert plan.num_parameters == PARAMETERS == 26_895_998_464
    assert plan.weight_bytes == 2 * PARAMETERS
    per_sequence = 8192 * KV_PER_TOKEN + STATE_PER_SEQUENCE
    assert plan.bytes_per_sequence == per_sequence
    assert plan.max_sequences == (80 * 2**30 - 2 * PARAMETERS) // per_sequence == 46


def test_plan_cli_on_a_bare_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG_27B))
    assert main(["plan", "--model", str(path), "--memory", "80", "--seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "65,536 B" in out and "153,944,064 B" in out and "26,895,998,464" in out
    assert out.rstrip().endswith("46")


def test_plan_for_the_default_dense_model(default_model_dir: Path) -> None:
    plan = plan_memory(ModelConfig.from_dir(default_model_dir), memory_gib=4, seq_len=2048)
    assert plan.num_parameters == 134_515_008  # SmolLM2-135M, tied embeddings counted once
    assert plan.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 and plan.state_bytes_per_sequence == 0


def test_plan_counts_hybrid_state_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_memory(ModelConfig.from_dict(CONFIG_27B), memory_gib=80, seq_len=8192, num_state_checkpoints=64)
    assert plan.state_checkpoint_bytes == 64 * STATE_PER_SEQUENCE == 9_852_420_096
    per_sequence = 8192 * KV_PER_TOKEN + STATE_PER_SEQUENCE
    assert plan.max_sequences == (80 * 2**30 - 2 * PARAMETERS - 64 * STATE_PER_SEQUENCE) // per_sequence == 32
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG_27B))
    argv = ["plan", "--model", str(path), "--memory", "80", "--seq-len", "8192", "--hybrid-state-checkpoints", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "64 state checkpoints" in out and "9,852,420,096 B" in out and out.rstrip().endswith("32")
