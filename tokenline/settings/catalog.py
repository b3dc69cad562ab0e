"""Every declared setting, from the records that own them, and the argparse parsers made of them."""

from __future__ import annotations

import argparse
from functools import cache
from typing import Any

from tokenline.engine.client import RestartPolicy
from tokenline.engine.config import EngineConfig
from tokenline.setting_field import API_COMMANDS, GROUPS, LIMITED, OFFLINE, SIMULATE, Declared, declared
from tokenline.settings.options import CommandOptions, RayOptions
from tokenline.settings.server import ServerSettings

# In --help's order within a group.
RECORDS: tuple[type, ...] = (ServerSettings, CommandOptions, EngineConfig, RestartPolicy, RayOptions)

GROUP_HELP = {
    "vLLM compatibility": "vLLM's serve flags with no tokenline setting of their own; see README 'Coming from vLLM'",
}


@cache
def all_declared() -> tuple[Declared, ...]:
    return tuple(d for record in RECORDS for d in declared(record))


def on(command: str) -> list[Declared]:
    """The settings ``command`` takes (serve, router, offline, simulate)."""
    return [d for d in all_declared() if command in d.setting.commands]


def parser_default(d: Declared, command: str) -> Any:
    """The flag's default on ``command``: a vLLM flag with values refused by name starts at None on
    serve and router, so a given value is seen and refused with its reason, not argparse's."""
    if command in API_COMMANDS and d.setting.vllm == LIMITED:
        return None
    return d.default


def _help(d: Declared, default: Any) -> str:
    text = d.setting.help
    shows_default = default not in (None, False, [], "") and "default" not in text
    if shows_default and d.setting.options.get("action") is not argparse.BooleanOptionalAction:
        text += " (default: %(default)s)"  # BooleanOptionalAction adds it itself
    return text


def argparse_options(d: Declared, command: str) -> dict[str, Any]:
    options = dict(d.setting.options)
    default = parser_default(d, command)
    if command in API_COMMANDS and d.setting.vllm == LIMITED and OFFLINE in d.setting.commands:
        # The engine's choices bind the offline commands; serve refuses vLLM's other values by name.
        options.pop("choices", None)
    if d.setting.flags:
        options["dest"] = d.dest
    return {"default": default, "help": _help(d, default), **options}


def add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    """Add the flags of ``command``'s settings to ``parser``, one argument group per concern."""
    members = on(command)
    for group in GROUPS:
        inside = [d for d in members if d.setting.group == group]
        if not inside:
            continue
        arguments = parser.add_argument_group(group, GROUP_HELP.get(group))
        for d in inside:
            names = d.setting.flags or (d.dest,)
            arguments.add_argument(*names, **argparse_options(d, command))


def command_of(args: argparse.Namespace) -> str:
    """The settings command ``args`` were parsed for (generate, trace, bench throughput: offline)."""
    if args.command == SIMULATE:
        return SIMULATE
    return args.command if args.command in API_COMMANDS else OFFLINE


def settings_kwargs(record: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``record`` that ``args``' command sets, converted; the others keep the record's
    defaults. A vLLM flag left unset (None) keeps the record's default too."""
    command = command_of(args)
    kwargs = {}
    for d in declared(record):
        if command not in d.setting.commands or not hasattr(args, d.dest):
            continue
        value = getattr(args, d.dest)
        if value is None and d.setting.vllm == LIMITED:
            continue
        kwargs[d.field.name] = d.setting.convert(value) if d.setting.convert else value
    return kwargs
