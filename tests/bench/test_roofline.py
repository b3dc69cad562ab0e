"""``tokenline bench roofline``: the bytes/FLOPs counting against a hand calculation, the bound's
choice of limit, and a small real run of the command on the default model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tokenline.bench.roofline import (
    CpuSample,
    MatmulParams,
    decode_cost,
    matmul_params_from_config,
    others_cpu_share,
    parse_size,
    roofline_bound,
)
from tokenline.cli import main as cli_main
from tokenline.model.config import ModelConfig

# SmolLM2-135M by hand: hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads of 64, vocab 49152.
H, I, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 30, 9, 3, 64, 49152
PER_LAYER = (
    H * HEADS * HEAD_DIM  # q
    + 2 * H * KV_HEADS * HEAD_DIM  # k, v
    + HEADS * HEAD_DIM * H  # o
    + 2 * H * I  # gate, up
    + I * H  # down
)
LAYER_PARAMS = LAYERS * PER_LAYER
LM_HEAD_PARAMS = VOCAB * H  # tied: the embedding matrix, counted once
MATMUL_PARAMS = LAYER_PARAMS + LM_HEAD_PARAMS
KV_BYTES_PER_TOKEN_BF16 = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # K and V, every layer, 2 bytes each


def test_smollm2_numbers_by_hand() -> None:
    assert PER_LAYER == 3_538_944
    assert MATMUL_PARAMS == 134_479_872  # 135M minus the norms


def test_cost_of_the_default_model_matches_the_hand_calculation(default_model_dir: Path) -> None:
    config = ModelConfig.from_dir(default_model_dir)
    params = matmul_params_from_config(config)
    assert params == MatmulParams(LAYER_PARAMS, LM_HEAD_PARAMS, tied_embeddings=True)

    batch, context = 8, 300
    cost = decode_cost(config, params, weight_dtype_size=2, kv_dtype_size=2, batch_size=batch, context_len=context)
    assert cost.weight_bytes == 2 * MATMUL_PARAMS
    assert cost.kv_bytes == batch * context * KV_BYTES_PER_TOKEN_BF16 == batch * context * 23_040
    assert cost.state_bytes == 0
    assert cost.flops_per_token == 2 * MATMUL_PARAMS + 4 * context * HEADS * HEAD_DIM * LAYERS
    assert cost.flops == batch * cost.flops_per_token

    fp32 = decode_cost(config, params, 4, 4, batch, context)
    assert fp32.weight_bytes == 2 * cost.weight_bytes and fp32.kv_bytes == 2 * cost.kv_bytes
    assert fp32.flops_per_token == cost.flops_per_token


def test_untied_lm_head_is_counted_and_the_embedding_is_not(default_model_dir: Path) -> None:
    config = ModelConfig.from_dir(default_model_dir)
    config.tie_word_embeddings = False
    params = matmul_params_from_config(config)
    # A separate lm_head has the same shape; the embedding lookup reads only B rows either way.
    assert params == MatmulParams(LAYER_PARAMS, LM_HEAD_PARAMS, tied_embeddings=False)


def test_bound_is_memory_at_batch_1_and_compute_when_flops_dominate() -> None:
    bandwidth, peak = 20e9, 1e12  # 20 GB/s, 1 TFLOP/s
    weight_bytes, flops_per_token = 270e6, 270e6

    small = roofline_bound(weight_bytes, 1 * flops_per_token, bandwidth, peak)
    assert small.limit == "memory"
    assert small.seconds == pytest.approx(weight_bytes / bandwidth) == pytest.approx(13.5e-3)
    assert small.compute_s == pytest.approx(0.27e-3)

    large = roofline_bound(weight_bytes, 1000 * flops_per_token, bandwidth, peak)
    assert large.limit == "compute"
    assert large.seconds == pytest.approx(1000 * flops_per_token / peak) == pytest.approx(0.27)
    assert large.memory_s == small.memory_s

    with pytest.raises(ValueError):
        roofline_bound(1, 1, 0, peak)


def test_others_cpu_share() -> None:
    cpus = os.cpu_count() or 1
    start = CpuSample(busy_s=10.0, own_s=1.0, wall_s=100.0)
    # Over 2 s the machine was busy 1.5 CPU-seconds, 0.5 of them ours: the others took 1 CPU-second.
    assert others_cpu_share(start, CpuSample(11.5, 1.5, 102.0)) == pytest.approx(1.0 / (2.0 * cpus))
    assert others_cpu_share(start, CpuSample(10.5, 1.5, 102.0)) == 0.0  # jiffy rounding never goes negative
    assert others_cpu_share(None, start) is None


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1G") == 1_000_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("lots")


def test_command_end_to_end(default_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "roofline.json"
    code = cli_main([
        "bench", "roofline", "--bandwidth-bytes", "64MiB", "--batch-sizes", "1", "2", "--steps", "3",
        "--warmup-steps", "1", "--prompt-len", "64", "--repeats", "2", "--matmul-size", "512",
        "--output-json", str(out),
    ])
    assert code == 0
    table = capsys.readouterr().out
    assert "read bandwidth" in table and "| batch |" in table

    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and report["steps"] == 3 and report["prompt_len"] == 64
    machine = report["machine"]
    bandwidth = machine["bandwidth"]
    assert set(bandwidth["by_method"]) == {"sum", "dot", "copy"}
    assert bandwidth["gb_per_s"] == max(bandwidth["by_method"].values()) > 0
    assert bandwidth["method"] in bandwidth["by_method"]
    assert bandwidth["buffer_bytes"] == 64 << 20
    assert machine["matmul_gflops"]["bfloat16"] > 0 and machine["matmul_gflops"]["float32"] > 0
    assert machine["torch_threads"] >= 1 and machine["load_avg_1m"] >= 0

    # Counted from the loaded model's linear layers: the same as from the config by hand.
    cost = report["model_cost"]
    assert (cost["layer_params"], cost["lm_head_params"], cost["tied_embeddings"]) == (
        LAYER_PARAMS, LM_HEAD_PARAMS, True,
    )
    assert cost["weight_bytes"] == 2 * MATMUL_PARAMS
    assert cost["kv_bytes_per_token"] == KV_BYTES_PER_TOKEN_BF16

    rows = report["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    for row in rows:
        batch = row["batch_size"]
        # Prompt 64, one token out of prefill, one warm-up step, then steps 0..2 (mean +1).
        assert 64 < row["context_len"] < 64 + 10
        assert 0 < row["step_s_p10"] <= row["step_s_p50"] <= row["step_s_p90"]
        assert row["others_cpu_share"] is None or 0 <= row["others_cpu_share"] <= 1
        assert row["tokens_per_s"] == pytest.approx(batch / row["step_s_p50"])
        assert row["kv_bytes"] == batch * round(row["context_len"]) * KV_BYTES_PER_TOKEN_BF16
        assert row["bound_memory_s"] == pytest.approx(cost["weight_bytes"] / (bandwidth["gb_per_s"] * 1e9))
        assert row["bound_s"] == max(row["bound_memory_s"], row["bound_compute_s"])
        assert row["bound_compute_s"] == pytest.approx(row["flops"] / (machine["matmul_gflops"]["bfloat16"] * 1e9))
        assert row["bound_with_kv_s"] >= row["bound_s"] > 0
        assert row["ratio"] == pytest.approx(row["step_s_p50"] / row["bound_s"])
        assert row["ratio_with_kv"] <= row["ratio"]
        if row["bound_memory_s"] > row["bound_compute_s"]:
            # Memory-bound: the KV read adds to the bound. Compute-bound (bf16 emulated on a CPU
            # without native bf16, say) it stays the FLOPs term.
            assert row["bound_with_kv_s"] > row["bound_s"] and row["ratio_with_kv"] < row["ratio"]
