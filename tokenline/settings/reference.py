"""docs/reference/configuration.md, written from the declarations (the settings' tables) and the
parser (the other commands' flags), so the reference cannot drift from the code.
``python scripts/configuration_reference.py`` rewrites it; a test holds the file equal to it."""

from __future__ import annotations

import argparse
from typing import Any

from tokenline.setting_field import GROUPS, OFFLINE, ROUTER, SERVE, SIMULATE, Declared
from tokenline.settings.catalog import GROUP_HELP, all_declared

COMMAND_NAMES = {SERVE: "serve", ROUTER: "router", OFFLINE: "generate, trace, bench throughput",
                 SIMULATE: "simulate"}


def format_default(value: Any) -> str:
    """A default as the reference shows it."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def documented_default(d: Declared) -> str:
    return d.setting.doc_default if d.setting.doc_default is not None else format_default(d.default)


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and angle brackets, which Markdown would take for HTML."""
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def _flag_cell(names: list[str], metavar: str | None) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else f"`{metavar}` (positional)"


def _setting_row(d: Declared) -> str:
    s = d.setting
    commands = ", ".join(COMMAND_NAMES[c] for c in (SERVE, ROUTER, OFFLINE, SIMULATE) if c in s.commands)
    what = s.help
    choices = s.options.get("choices")
    if choices:
        what += f". Choices: {', '.join(map(str, choices))}"
    default = documented_default(d)
    return (f"| {_flag_cell(list(s.flags), d.field.name.upper())} | {f'`{_cell(default)}`' if default else ''} "
            f"| {commands} | {s.vllm or ''} | {_cell(what)} |")


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command under ``parser``, named as typed ("bench serve"), with its parser."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((prefix + name, sub))
                found += subcommands(sub, prefix + name + " ")
    return found


def _action_row(action: argparse.Action) -> str:
    names = list(action.option_strings)
    default = "" if action.default in (None, False, argparse.SUPPRESS) else format_default(action.default)
    what = (action.help or "") % {"default": action.default, "prog": ""}
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        what += f". Choices: {', '.join(map(str, action.choices))}"
    return (f"| {_flag_cell(names, action.dest.upper())} | {f'`{_cell(default)}`' if default else ''} "
            f"| {_cell(what)} |")


def configuration_reference(parser: argparse.ArgumentParser) -> str:
    """The reference page: the declared settings by concern, then the other commands' own flags
    (``parser``: tokenline.cli.build_parser())."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Written by `python scripts/configuration_reference.py` from the settings' declarations "
        "(tokenline/settings/, EngineConfig, RestartPolicy) and the command-line parser; do not edit. -->",
        "",
        "Every setting of `tokenline serve` and `tokenline router`, and the engine settings that "
        "`generate`, `trace` and `bench throughput` share, grouped as `--help` groups them. "
        "`serve` and `router` also read them from a YAML file, as vLLM does: `--config FILE.yaml` holds a "
        "mapping of flag names without their dashes (`kv-cache-memory: 4` or `kv_cache_memory: 4`; "
        "`true`/`false` for switches, a list for flags taking several values); flags on the command line "
        "override the file, and a key that is not a flag of the command is an error.",
        "",
        "The **vLLM** column says what a flag of `vllm serve` does here: *wired* to the setting of the same "
        "meaning, *limited* (some values refused, with the reason), or *no effect* (accepted and named in one "
        "start-up warning). An empty default is none (the help says what applies then).",
    ]
    for group in GROUPS:
        rows = [d for d in all_declared() if d.setting.group == group]
        if not rows:
            continue
        out += ["", f"## {group if group.startswith('vLLM') else group[0].upper() + group[1:]}", ""]
        if group in GROUP_HELP:
            out += [GROUP_HELP[group] + ".", ""]
        out += ["| Flag | Default | Commands | vLLM | What it does |", "|---|---|---|---|---|"]
        out += [_setting_row(d) for d in rows]
    out += ["", "## Each command's own flags", "",
            "Besides the settings above that a command takes (generate, trace and bench throughput: the engine's; "
            "simulate: the step budget and routing)."]
    for name, sub in subcommands(parser):
        own = [a for group in sub._action_groups if group.title not in GROUPS for a in group._group_actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if not own:
            continue
        out += ["", f"### tokenline {name}", "", _cell(_summary(parser, name)), "",
                "| Flag | Default | What it does |", "|---|---|---|"]
        out += [_action_row(a) for a in own]
    return "\n".join(out) + "\n"


def _summary(parser: argparse.ArgumentParser, name: str) -> str:
    """A subcommand's one-line help, as its parent lists it."""
    *parents, last = name.split(" ")
    for part in parents:
        parser = _choices(parser)[part]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == last:
                    return choice.help or ""
    return ""


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}
