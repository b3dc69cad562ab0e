"""Every setting declared once (tokenline/settings/): the parsers, the records, `--config` files and
the configuration reference all come from the declarations, so they agree. No server is started."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenline.api.app import ServerSettings
from tokenline.cli import build_parser, engine_config_from_args, parse_args, router_settings_from_args
from tokenline.cli import serve_settings_from_args
from tokenline.engine.config import EngineConfig
from tokenline.setting_field import GROUPS, SERVE
from tokenline.settings.catalog import all_declared, on, settings_kwargs
from tokenline.settings.reference import configuration_reference, documented_default, format_default, subcommands

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "configuration.md"


def test_every_flag_of_every_command_has_help() -> None:
    parser = build_parser()
    missing = [f"tokenline {name} {action.option_strings or action.dest}"
               for name, sub in [("", parser), *subcommands(parser)] for action in sub._actions
               if not (action.help or "").strip()]
    assert not missing, missing


def test_default_flags_give_the_records_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A default is written once, on the record: no flag default can differ from it."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    settings, idle = serve_settings_from_args(build_parser().parse_args(["serve"]))
    assert settings == ServerSettings() and idle == []
    for command in (["generate", "hi"], ["trace", "hi"], ["bench", "throughput"]):
        assert engine_config_from_args(build_parser().parse_args(command)) == EngineConfig(), command
    url = "http://127.0.0.1:9"
    settings, _ = router_settings_from_args(build_parser().parse_args(["router", "--upstream", url]))
    assert settings == dataclasses.replace(ServerSettings(), upstreams=[url])


def test_each_flag_fills_its_own_field() -> None:
    checked = 0
    for d in on(SERVE):
        kind = d.setting.options.get("type")
        if kind not in (int, float) or not d.setting.flags:
            continue
        args = build_parser().parse_args(["serve", d.setting.flags[0], "3"])
        value = d.setting.convert(kind(3)) if d.setting.convert else kind(3)
        assert settings_kwargs(d.owner, args)[d.field.name] == value, d.name
        checked += 1
    assert checked > 30


def test_serve_help_is_grouped_by_concern() -> None:
    serve = dict(subcommands(build_parser()))["serve"]
    titles = [g.title for g in serve._action_groups if g._group_actions and g.title in GROUPS]
    assert titles == [g for g in GROUPS if g in titles] and len(titles) >= 10
    where = {a.dest: g.title for g in serve._action_groups for a in g._group_actions}
    assert (where["kv_cache_memory"], where["api_key"], where["routing_policy"]) == (
        "KV cache", "tenants and limits", "fleet and routing")
    assert where["tensor_parallel_size"] == "vLLM compatibility"
    text = serve.format_help()
    assert "\nKV cache:\n" in text and "--max-num-seqs MAX_NUM_SEQS" in text


def test_config_file_values_are_defaults_the_command_line_overrides(default_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {default_model_dir}\nport: 8123\nkv_cache_memory: 3\nserved-model-name: [a, b]\n"
                      "enable-prefix-caching: false\nlog-prompts: true\nmax-connections: 0\n"
                      "speculative-config: {method: ngram, num_speculative_tokens: 3}\n")
    args = parse_args(["serve", "--config", str(config), "--port", "9000"])
    settings, idle = serve_settings_from_args(args)
    assert settings.model == str(default_model_dir) and settings.port == 9000  # the command line wins
    assert settings.served_model_name == ["a", "b"] and settings.log_prompts and settings.max_connections is None
    e = settings.engine
    assert (e.kv_cache_memory_gib, e.enable_prefix_caching, e.speculative, e.num_speculative_tokens) == (
        3.0, False, "ngram", 3)
    # A switch the file turns on stays on; the same file on another command line gives its port.
    assert parse_args(["serve", "--config", str(config)]).port == 8123


def test_router_config_file_with_repeated_flags(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("upstream: [http://127.0.0.1:9, http://127.0.0.1:10]\nunhealthy_after: 5\n")
    args = parse_args(["router", "--config", str(config)])
    assert args.upstream == ["http://127.0.0.1:9", "http://127.0.0.1:10"] and args.unhealthy_after == 5


@pytest.mark.parametrize(("text", "message"), [
    ("bogus-key: 1\n", "unknown key 'bogus-key' (not a flag of `tokenline serve`)"),
    ("config: other.yaml\n", "unknown key 'config'"),
    ("- port\n", "expected a mapping of flag names to values, got list"),
    ("port: abc\n", "argument --port: invalid int value: 'abc'"),
    ("tool-call-parser: nope\n", "argument --tool-call-parser: invalid choice: 'nope'"),
])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                                message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as caught:
        parse_args(["serve", "--config", str(config)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert caught.value.code == 2 and f"--config {config}: " in line and message in line, line


def test_a_missing_config_file_exits_2_with_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tokenline.cli", "serve", "--config", str(tmp_path / "no.yaml")],
                          capture_output=True, text=True, timeout=60)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith("tokenline serve: error: --config ") and "no.yaml" in line


def test_the_configuration_reference_is_generated_from_the_declarations() -> None:
    assert REFERENCE.read_text() == configuration_reference(build_parser()), (
        "docs/reference/configuration.md is out of date: run python scripts/configuration_reference.py")


def _documented_defaults() -> dict[str, str]:
    """Flag (or positional name) -> the default the committed reference shows, from its settings tables."""
    settings_part = REFERENCE.read_text().split("## Each command's own flags")[0]
    rows = re.findall(r"^\| `([^`]+)`[^|]*\| (?:`([^`]*)`)? \|", settings_part, flags=re.M)
    return {flag: default for flag, default in rows}


def test_documented_defaults_are_the_codes() -> None:
    documented = _documented_defaults()
    assert len(documented) == len(all_declared())
    parser_defaults = {a.option_strings[0] if a.option_strings else a.dest.upper(): a.default
                       for _, sub in subcommands(build_parser()) for group in sub._action_groups
                       if group.title in GROUPS for a in group._group_actions}
    for d in all_declared():
        key = d.setting.flags[0] if d.setting.flags else d.field.name.upper()
        record_default = getattr(d.owner(), d.field.name)
        expected = d.setting.doc_default if d.setting.doc_default is not None else format_default(record_default)
        assert documented[key].replace("&lt;", "<") == expected == documented_default(d), key
        if d.setting.doc_default is None and parser_defaults.get(key) is not None:
            assert format_default(parser_defaults[key]) == expected, key
