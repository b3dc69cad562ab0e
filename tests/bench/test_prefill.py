"""``tokenline bench prefill``: a small real run on the default model. The timers must see every
decoder linear of every prompt row (their FLOPs add up to the model's by hand), the prefix must come
from the cache, and the steps must be the chunks the budget makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenline.bench.prefill import PartTimes, PrefillConfig
from tokenline.cli import main as cli_main

# SmolLM2-135M's decoder linears by hand: 30 layers of q|k|v, o, gate|up and down (hidden 576,
# intermediate 1536, 9 query and 3 KV heads of 64); the tied head is not one of them.
LAYER_PARAMS = 30 * (576 * (9 + 2 * 3) * 64 + 9 * 64 * 576 + 2 * 576 * 1536 + 1536 * 576)


def test_part_times_add_up() -> None:
    total = PartTimes()
    total.add(PartTimes(linear_s=0.5, linear_flops=4_000_000_000, attention_s=0.25, step_s=1.0))
    total.add(PartTimes(linear_s=0.5, linear_flops=4_000_000_000, attention_s=0.25, step_s=1.0))
    assert total.linear_gflops == pytest.approx(8.0)
    assert total.attention_over_linears == pytest.approx(0.5)
    with pytest.raises(ValueError):
        PrefillConfig(prompt_len=0).validate()
    with pytest.raises(ValueError):
        PrefillConfig(chunk=0).validate()
    with pytest.raises(ValueError):
        PrefillConfig(prompt_len=512, cached_prefix=512).validate()
    with pytest.raises(ValueError):
        PrefillConfig(clock="gpu").validate()


def test_command_end_to_end(default_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prefill.json"
    # Chunks of 96 rows: more than the one-call decode layer takes, so every step runs the linears.
    code = cli_main([
        "bench", "prefill", "--prompt-len", "240", "--cached-prefix", "48", "--chunk", "96", "--repeats", "1",
        "--matmul-size", "256", "--output-json", str(out),
    ])
    assert code == 0
    table = capsys.readouterr().out
    assert "bfloat16 matmul peak" in table and "| step | tokens |" in table and "new prompt tokens/s" in table

    report = json.loads(out.read_text())
    assert report["prompt_len"] == 240 and report["cached_prefix"] == 48 and report["chunk"] == 96
    assert report["matmul_gflops_bf16"] > 0 and report["clock"] == "wall"
    [run] = report["runs"]
    # The 48 cached tokens (three whole blocks) come from the cache; the 192 new ones go in two chunks.
    assert [(s["tokens"], s["context_len"]) for s in run] == [(96, 144), (96, 240)]
    for step in run:
        assert step["linear_flops"] == 2 * step["tokens"] * LAYER_PARAMS
        assert 0 < step["linear_s"] and 0 < step["attention_s"]
        assert step["linear_s"] + step["attention_s"] < step["step_s"]
    median = report["median"]
    assert median["linear_flops"] == 2 * 192 * LAYER_PARAMS
    assert median["new_tokens_per_s"] > 0


def test_bad_values_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "prefill", "--prompt-len", "0"]) == 2
    assert "prompt_len" in capsys.readouterr().err
