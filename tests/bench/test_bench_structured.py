"""`tokenline bench throughput --structured-json-schema`: the same workload without and with a
schema on every request, on one engine, with compile-time percentiles."""

from __future__ import annotations

from pathlib import Path

from tokenline.bench.throughput import (
    ThroughputResult,
    format_table,
    run_tokenline_structured,
    synthetic_prompts,
)
from tokenline.engine.config import EngineConfig

SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string", "minLength": 200}},
    "required": ["summary"],
    "additionalProperties": False,
}


def test_structured_bench_runs_both_ways_on_one_engine(default_model_dir: Path) -> None:
    prompts = synthetic_prompts(3, 16, 49152, {0, 1, 2}, seed=0)
    config = EngineConfig(dtype="float32", num_kv_blocks=64)
    bench = run_tokenline_structured(default_model_dir, prompts, 8, config, SCHEMA, repeats=1, num_compiles=5)
    assert bench.unconstrained.constraint == "none" and bench.constrained.constraint == "json"
    assert bench.unconstrained.output_tokens == bench.constrained.output_tokens == 3 * 8
    assert len(bench.compile_ms) == 5 and bench.percentile_ms(0.5) <= bench.percentile_ms(0.99)
    assert bench.engine_compiles + bench.engine_cache_hits == 3  # one compilation, shared by the rest
    summary = bench.summary()
    assert "output tok/s" in summary and "p50" in summary and "p99" in summary


def test_table_has_a_grammar_column_only_with_constraints() -> None:
    plain = ThroughputResult("tokenline", "bfloat16", 4, 1000, 512, 10.0)
    constrained = ThroughputResult("tokenline", "bfloat16", 4, 1000, 512, 11.0, constraint="json")
    assert "grammar" not in format_table([plain])
    table = format_table([plain, constrained]).splitlines()
    assert "grammar" in table[0] and "none" in table[1] and "json" in table[2]
