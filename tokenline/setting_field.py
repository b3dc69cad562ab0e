"""How a setting is declared: ``setting(...)`` as a dataclass field's default, carrying the flag,
help, group, the commands that take it and what a vLLM command line's flag of that name does here.

A leaf module (no tokenline imports), so that the records that own a setting (``EngineConfig``,
``RestartPolicy``, ``ServerSettings``) can declare it where the field is."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# The commands a setting is on. OFFLINE: the commands that load the engine in-process (generate,
# trace, bench throughput).
SERVE, ROUTER, OFFLINE, SIMULATE = "serve", "router", "offline", "simulate"
ENGINE_COMMANDS = frozenset({SERVE, OFFLINE})
API_COMMANDS = frozenset({SERVE, ROUTER})

# --help's groups, in the order they are shown (and the reference's sections).
MODEL = "model"
ENGINE = "engine and scheduler"
KV_CACHE = "KV cache"
SPECULATIVE = "speculative decoding"
STRUCTURED = "structured output"
SERVER = "API server"
TENANTS = "tenants and limits"
CONNECTIONS = "connections and timeouts"
OBSERVABILITY = "observability"
FLEET = "fleet and routing"
RESTARTS = "engine restarts"
SIMULATION = "simulation"
VLLM = "vLLM compatibility"
GROUPS: tuple[str, ...] = (MODEL, ENGINE, KV_CACHE, SPECULATIVE, STRUCTURED, SERVER, TENANTS, CONNECTIONS,
                           OBSERVABILITY, FLEET, RESTARTS, SIMULATION, VLLM)

# What a flag taken from vLLM's `serve` does here: wired to the setting of the same meaning,
# accepted with no effect (named in one start-up warning), or limited (some values refused).
WIRED, NO_EFFECT, LIMITED = "wired", "no effect", "limited"


def _never(value: Any) -> str | None:
    return None


@dataclass(frozen=True)
class Setting:
    flags: tuple[str, ...]  # the long flag first, then short forms; () for a positional
    help: str
    group: str
    commands: frozenset[str]
    # argparse options besides default and help: type, choices, action, nargs, metavar, dest
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The command-line value as the field's value (e.g. 0 meaning "no limit" as None).
    convert: Callable[[Any], Any] | None = None
    vllm: str | None = None  # WIRED, NO_EFFECT or LIMITED: a flag of vLLM's serve
    refuse: Callable[[Any], str | None] = _never  # why a given value cannot be honoured, or None
    # The given value changes nothing here (default: any given value of a NO_EFFECT flag).
    idle: Callable[[Any], bool] | None = None
    doc_default: str | None = None  # the reference's default where the value is computed (e.g. "$VLLM_API_KEY")

    def has_no_effect(self, value: Any) -> bool:
        if value is None:
            return False  # not given
        if self.idle is not None:
            return self.idle(value)
        return self.vllm == NO_EFFECT and value is not False  # a switch left off was not given


def setting(default: Any = dataclasses.MISSING, *flags: str, help: str, group: str,
            commands: frozenset[str] | set[str] = ENGINE_COMMANDS, default_factory: Any = dataclasses.MISSING,
            **details: Any) -> Any:
    """A dataclass field declaring one setting: ``flags`` (none: a positional argument), the
    ``commands`` that take it (default: serve and the offline engine commands), and in ``details``
    Setting's other fields and argparse options (``type``, ``choices``, ``action``, ``metavar``, ``nargs``,
    ``dest``)."""
    own = {name: details.pop(name) for name in list(details) if name in _SETTING_FIELDS}
    meta = Setting(flags=flags, help=help, group=group, commands=frozenset(commands), options=details, **own)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"setting": meta})


_SETTING_FIELDS = {"convert", "vllm", "refuse", "idle", "doc_default"}


@dataclass(frozen=True)
class Declared:
    """One declared setting: the record's field and its declaration."""

    owner: type
    field: dataclasses.Field
    setting: Setting

    @property
    def dest(self) -> str:
        """The attribute argparse stores it in: argparse's own choice (from the long flag)."""
        if "dest" in self.setting.options:
            return self.setting.options["dest"]
        return self.setting.flags[0].lstrip("-").replace("-", "_") if self.setting.flags else self.field.name

    @property
    def name(self) -> str:
        return self.setting.flags[0] if self.setting.flags else self.field.name

    @property
    def default(self) -> Any:
        """The value the parser starts from."""
        if self.field.default is not dataclasses.MISSING:
            return self.field.default
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return None


def declared(cls: type) -> Iterator[Declared]:
    """The settings a dataclass declares, in field order."""
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("setting")
        if meta is not None:
            yield Declared(cls, f, meta)
