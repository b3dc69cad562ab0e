"""vLLM's `serve` flags on `tokenline serve`, checked at the parser: what each sets, which ones the
start-up warning names, which values are refused with one line. No server is started here (the
e2e test tests/e2e/test_vllm_command_line.py runs a copied `vllm serve` command line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenline.cli import build_parser, serve_settings_from_args
from tokenline.settings.vllm_flags import VLLM_FLAGS, no_effect_warning


def settings(default_model_dir: Path, *flags: str):  # noqa: ANN201 - (ServerSettings, idle flags)
    args = build_parser().parse_args(["serve", "--model", str(default_model_dir), *flags])
    return serve_settings_from_args(args)


def test_wired_flags_reach_the_settings_and_engine_config(default_model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text('{"temperature": 0.3}')
    s, idle = settings(
        default_model_dir, "--served-model-name", "a", "b", "--enable-auto-tool-choice", "--tool-call-parser",
        "hermes", "--chat-template", str(template), "--generation-config", str(tmp_path / "gen"), "--seed", "7",
        "--uvicorn-log-level", "warning", "--no-enable-prefix-caching", "--max-num-batched-tokens", "512",
        "--max-model-len", "1024", "--tokenizer", str(default_model_dir), "--enable-chunked-prefill",
        "--kv-cache-dtype", "auto",
    )
    assert s.model == str(default_model_dir) and s.served_model_name == ["a", "b"]
    assert s.tool_call_parser == "hermes" and s.chat_template == template.read_text()
    assert s.generation_config == str(tmp_path / "gen") and s.uvicorn_log_level == "warning"
    e = s.engine
    assert (e.seed, e.enable_prefix_caching, e.max_num_batched_tokens, e.max_model_len) == (7, False, 512, 1024)
    assert e.tokenizer == str(default_model_dir)
    assert idle == []  # every flag above is honoured: none is named as having no effect


def test_speculative_config_sets_the_speculative_flags(default_model_dir: Path) -> None:
    s, idle = settings(default_model_dir, "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    e = s.engine
    assert (e.speculative, e.num_speculative_tokens, e.prompt_lookup_max) == ("ngram", 3, 5) and idle == []



def test_speculative_config_suffix_and_its_options(default_model_dir: Path) -> None:
    s, idle = settings(default_model_dir, "--speculative-config",
                       '{"method": "suffix", "num_speculative_tokens": 12, "suffix_decoding_max_tree_depth": 32, '
                       '"suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.2}')
    e = s.engine
    assert (e.speculative, e.num_speculative_tokens, e.suffix_decoding_max_tree_depth) == ("suffix", 12, 32)
    assert (e.suffix_decoding_max_spec_factor, e.suffix_decoding_min_token_prob) == (2.0, 0.2) and idle == []
    s, _ = settings(default_model_dir, "--speculative", "suffix", "--suffix-decoding-max-spec-factor", "0.5")
    assert (s.engine.speculative, s.engine.suffix_decoding_max_spec_factor) == ("suffix", 0.5)

def test_defaults_and_the_positional_model(default_model_dir: Path) -> None:
    args = build_parser().parse_args(["serve", str(default_model_dir), "--enable-prefix-caching"])
    s, idle = serve_settings_from_args(args)
    assert s.model == str(default_model_dir) and s.served_model_name is None
    assert s.generation_config == "auto" and s.chat_template is None and s.engine.seed is None
    assert s.engine.enable_prefix_caching and idle == []
    # The prefix cache grows into fresh KV memory up to 0.5 GiB of the pool, then evicts first.
    assert s.engine.prefix_cache_fills_pool is None and s.engine.prefix_cache_resident_memory_gib == 0.5


def test_quantization_reaches_the_engine(default_model_dir: Path) -> None:
    s, idle = settings(default_model_dir, "--quantization", "q4_1")
    assert s.engine.quantization == "q4_1" and idle == []
    s, _ = settings(default_model_dir, "-q", "q8_0")
    assert s.engine.quantization == "q8_0"
    args = build_parser().parse_args(["bench", "throughput", "-q", "q4_1"])
    assert args.quantization == "q4_1"


def test_kv_cache_dtype_reaches_the_engine(default_model_dir: Path) -> None:
    s, idle = settings(default_model_dir, "--kv-cache-dtype", "bfloat16")
    assert s.engine.kv_cache_dtype == "bfloat16" and idle == []
    assert settings(default_model_dir)[0].engine.kv_cache_dtype == "auto"
    args = build_parser().parse_args(["bench", "throughput", "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"


def test_prefix_cache_fills_pool_reaches_the_engine(default_model_dir: Path) -> None:
    s, idle = settings(default_model_dir, "--prefix-cache-fills-pool")
    assert s.engine.prefix_cache_fills_pool and idle == []
    assert s.engine.cache_resident_blocks(1000, 1 << 20) is None  # the whole pool
    s, _ = settings(default_model_dir, "--no-prefix-cache-fills-pool")
    assert s.engine.cache_resident_blocks(1000, 1 << 20) == 0
    s, _ = settings(default_model_dir, "--prefix-cache-resident-memory", "0.25")
    assert s.engine.cache_resident_blocks(1000, 1 << 20) == 256  # 0.25 GiB of 1 MiB blocks
    assert s.engine.cache_resident_blocks(100, 1 << 20) == 100  # never more than the pool


def test_inline_chat_template_with_escaped_newlines(default_model_dir: Path) -> None:
    s, _ = settings(default_model_dir, "--chat-template", "{{ messages[0].content }}\\n")
    assert s.chat_template == "{{ messages[0].content }}\n"


def test_flags_without_effect_are_all_named_in_one_warning(default_model_dir: Path) -> None:
    _, idle = settings(
        default_model_dir, "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "1",
        "--enforce-eager", "--swap-space", "4", "--trust-remote-code", "--download-dir", "/tmp/x",
        "--disable-log-stats", "--max-logprobs", "5", "--distributed-executor-backend", "mp",
        "--no-enable-chunked-prefill", "--cpu-offload-gb", "0", "--disable-log-requests",
    )
    line = no_effect_warning(idle)
    assert line is not None and "\n" not in line
    for flag in ("--gpu-memory-utilization 0.9", "--tensor-parallel-size 1",
                 "--enforce-eager", "--swap-space 4.0", "--trust-remote-code", "--download-dir /tmp/x",
                 "--disable-log-stats", "--max-logprobs 5", "--distributed-executor-backend mp",
                 "--enable-chunked-prefill", "--cpu-offload-gb 0.0"):
        assert flag in line, flag
    assert "--disable-log-requests" not in line  # honoured: it has an effect


def test_every_table_flag_has_a_status_and_an_explanation() -> None:
    for flag in VLLM_FLAGS:
        assert flag.status in ("wired", "no effect", "limited") and flag.does, flag.names


@pytest.mark.parametrize(("flags", "message"), [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size: tokenline runs one engine on one device"),
    (["-pp", "4"], "--pipeline-parallel-size: tokenline runs one engine on one device"),
    (["--data-parallel-size", "0"], "--data-parallel-size: must be at least 1"),
    (["-dp", "2", "--routing-policy", "fastest"], "fastest"),
    (["--quantization", "awq"], "--quantization: quantization 'awq' is not supported"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: kv cache dtype 'fp8' is not supported"),
    (["--max-logprobs", "50"], "--max-logprobs: at most 20 logprobs"),
    (["--distributed-executor-backend", "ray"], "executor backend 'ray' is not supported"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--chat-template", "no_such_template.jinja"], "neither a file nor an inline Jinja template"),
    (["--chat-template", "{% if %}"], "chat template does not compile"),
    (["--generation-config", "/no/such/folder"], "no such file"),
    (["--tokenizer", "org/some-tokenizer"], "is not a directory with a tokenizer.json"),
    (["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'], "method 'eagle3' is not supported"),
    (["--speculative-config", '{"method": "ngram", "model": "draft"}'], "['model'] not supported"),
    (["--speculative-config", '{"method": "ngram"}', "--speculative", "ngram"], "not both"),
    (["--speculative-config", '{"method": "mtp"}'], "needs a hybrid Qwen3.5-class model with an MTP head"),
    (["--speculative-config", "[2]"], "--speculative-config must be a JSON object"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "port": 5557}'], "--kv-events-config: ['port'] not"),
    (["--kv-events-config", "{enable}"], "--kv-events-config is not valid JSON"),
])
def test_values_tokenline_cannot_honour_are_refused(default_model_dir: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        settings(default_model_dir, *flags)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_two_different_models_are_refused(default_model_dir: Path, tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", str(default_model_dir), "--model", str(tmp_path)])
    with pytest.raises(ValueError, match="two models given"):
        serve_settings_from_args(args)


def test_unknown_flags_still_fail() -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--no-such-vllm-flag", "1"])
    assert caught.value.code == 2


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenline.cli", "serve", *args],
                          capture_output=True, text=True, timeout=60)


def test_a_hugging_face_repo_id_gets_one_line_and_exit_2() -> None:
    for args in (["HuggingFaceTB/SmolLM2-135M-Instruct"], ["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]):
        done = run_serve(*args)
        assert done.returncode == 2 and done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert "HuggingFaceTB/SmolLM2-135M-Instruct" in lines[0] and "downloads nothing" in lines[0]
        assert "tokenline import" in lines[0]


def test_a_packaged_models_name_is_a_model_argument() -> None:
    """`serve --model gemma3-270m` names the package's model, as `tokenline import gemma3-270m` does: past
    the model check, the next refusal is the flag's (nothing is loaded)."""
    done = run_serve("--model", "gemma3-270m", "--tensor-parallel-size", "2")
    assert done.returncode == 2
    assert "downloads nothing" not in done.stderr and "--tensor-parallel-size" in done.stderr


def test_an_unsupported_value_exits_2_with_one_line(default_model_dir: Path) -> None:
    done = run_serve("--model", str(default_model_dir), "--tensor-parallel-size", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "tokenline serve: error: --tensor-parallel-size: tokenline runs one engine on one device; "
        "only 1 is supported, got 2"
    ]


@pytest.mark.parametrize("source", ["auto", "vllm", "folder"])
def test_generation_config_sets_the_processors_sampling_defaults(
    default_model_dir: Path, tmp_path: Path, source: str
) -> None:
    from tests.gateway.fake_engine import FakeEngineClient
    from tokenline.api.app import ServerSettings, build_app

    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"temperature": 0.25, "top_k": 5}')
    chosen = str(folder) if source == "folder" else source
    app = build_app(ServerSettings(model=str(default_model_dir), generation_config=chosen,
                                   usage_db=str(tmp_path / "u.sqlite3")), client=FakeEngineClient([1]))
    expected = {
        "auto": json.loads((default_model_dir / "generation_config.json").read_text()),
        "vllm": {},
        "folder": {"temperature": 0.25, "top_k": 5},
    }[source]
    assert app.state.serving.processor.generation_config == expected


@pytest.mark.parametrize(("flag", "value"), [
    ("--tool-call-parser", "llama3_json"), ("--tool-call-parser", "llama4_json"), ("--tool-call-parser", "pythonic"),
    ("--reasoning-parser", "deepseek_r1"),
])
def test_the_parsers_vllm_users_name_are_accepted(default_model_dir: Path, flag: str, value: str) -> None:
    s, idle = settings(default_model_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", flag, value)
    assert getattr(s, flag[2:].replace("-", "_")) == value and idle == []


def test_an_unknown_flag_gets_one_line_naming_the_subcommand() -> None:
    done = run_serve("--bogus")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "tokenline serve: error: unrecognized arguments: --bogus (see `tokenline serve --help`)"
    ]
    # A bad value is one line too, not serve's pages of usage.
    done = run_serve("--tool-call-parser", "nope")
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith("tokenline serve: error: argument --tool-call-parser")
