"""``--config FILE.yaml`` as vLLM reads it: a mapping of flag names without their dashes (``port``,
``kv-cache-memory`` or ``kv_cache_memory``) to values. The file's values become the command's
defaults, so a flag on the command line overrides them; an unknown key is an error naming it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def config_file_argv(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The file's settings as command-line tokens for ``parser`` (its command's parser); the parser's
    error (exit 2, one line) for a file that cannot be read or a key that is not a flag of it."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}".replace("\n", " "))
    if data is None:
        return []
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None or flag == "--config":
            parser.error(f"--config {path}: unknown key {key!r} (not a flag of `{parser.prog}`)")
        argv += _tokens(flag, action, value)
    return argv


def _tokens(flag: str, action: argparse.Action, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # a switch: true gives it, false leaves it off
        return [flag] if value else []
    if isinstance(value, dict):  # a JSON-object flag (--speculative-config, --kv-events-config)
        return [flag, json.dumps(value)]
    items = value if isinstance(value, list) else [value]
    if isinstance(action, argparse._AppendAction):
        return [token for item in items for token in (flag, _text(item))]
    return [flag, *map(_text, items)]


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the file's values ``parser``'s defaults (checked and converted as the flags would be)."""
    argv = config_file_argv(parser, path)
    exit_on_error, parser.exit_on_error = parser.exit_on_error, False  # a bad value: name the file
    try:
        given = parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        parser.error(f"--config {path}: {exc}")
    finally:
        parser.exit_on_error = exit_on_error
    dests = {parser._option_string_actions[token].dest for token in argv if token in parser._option_string_actions}
    dests |= {parser._option_string_actions["--" + t[5:]].dest for t in argv
              if t.startswith("--no-") and "--" + t[5:] in parser._option_string_actions}
    parser.set_defaults(**{dest: getattr(given, dest) for dest in dests})
