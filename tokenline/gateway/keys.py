"""API keys and tenants: who is calling, which models they may use, and their limits.

Tenants live in a TOML file (one ``[[tenant]]`` table each) that stores only the SHA-256 of each
key, so a leaked file (or a log of it) gives nobody a working key. ``tokenline keys add`` creates
a key, appends its hash and prints the key once.

```toml
[[tenant]]
name = "acme"
key_sha256 = "<hex sha256 of the key>"
models = ["*"]                 # or a list of served model names
requests_per_minute = 60       # each limit optional; absent = unlimited
tokens_per_minute = 20000
max_concurrent = 4
daily_tokens = 1000000
admin = false                  # may call admin endpoints (usage, reload)

[[tenant.content_filter]]      # optional: this tenant's safety filters (gateway/filters.py);
type = "blocklist"             # none listed: the server's --content-filter default;
words = ["..."]                # `content_filter = []`: no filters for this tenant
```
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenline.gateway.filters import ContentFilter, FilterConfigError, parse_filters

__all__ = ["KeyFileError", "KeyStore", "Tenant", "TenantLimits", "add_key", "hash_key"]

logger = logging.getLogger(__name__)

# Tenant names end up in rate-limit keys (`tokenline:rl:{name}:...`), metrics labels and logs, so
# they are kept to characters that need no quoting anywhere.
_NAME_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "daily_tokens")
_TENANT_FIELDS = frozenset({"name", "key_sha256", "models", "admin", "content_filter", *_LIMIT_FIELDS})
KEY_PREFIX = "tl-"


class KeyFileError(ValueError):
    """The keys file is missing, not TOML, or describes a tenant wrongly; the message says where."""


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant limits; ``None`` means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    daily_tokens: int | None = None

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, name) is None for name in _LIMIT_FIELDS)


@dataclass(frozen=True)
class Tenant:
    name: str
    # Kept out of repr so that logging a tenant does not spread even the hash around.
    key_sha256: str = field(repr=False)
    models: tuple[str, ...] = ("*",)
    limits: TenantLimits = TenantLimits()
    admin: bool = False
    # The tenant's own safety filters ([[tenant.content_filter]]); None: the server's default.
    content_filters: tuple[ContentFilter, ...] | None = field(default=None, repr=False, compare=False)


def hash_key(key: str) -> str:
    """The hex SHA-256 a keys file stores for ``key``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _parse_limit(where: str, name: str, value: Any) -> int | None:
    if value is None:
        return None
    # bool is an int in Python; `max_concurrent = true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeyFileError(f"{where}: {name} must be a positive integer (omit it for unlimited), got {value!r}")
    return value


def _parse_tenant(where: str, table: Any) -> Tenant:
    if not isinstance(table, Mapping):
        raise KeyFileError(f"{where}: must be a table")
    unknown = sorted(set(table) - _TENANT_FIELDS)
    if unknown:
        # A misspelt limit would otherwise silently mean "unlimited".
        allowed = ", ".join(sorted(_TENANT_FIELDS))
        raise KeyFileError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {allowed}")
    name = table.get("name")
    if not isinstance(name, str) or not _NAME_OK.fullmatch(name):
        raise KeyFileError(f"{where}: name must be 1-64 characters of A-Z a-z 0-9 _ . - , got {name!r}")
    where = f"{where} ({name!r})"
    digest = table.get("key_sha256")
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest.lower()):
        raise KeyFileError(f"{where}: key_sha256 must be 64 hex digits (the SHA-256 of the key, not the key)")
    models = table.get("models", ["*"])
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise KeyFileError(f"{where}: models must be a non-empty list of model names or [\"*\"]")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise KeyFileError(f"{where}: admin must be true or false")
    limits = TenantLimits(**{f: _parse_limit(where, f, table.get(f)) for f in _LIMIT_FIELDS})
    filters = None
    if "content_filter" in table:
        try:
            filters = parse_filters(where, table["content_filter"])
        except FilterConfigError as exc:
            raise KeyFileError(str(exc)) from None
    return Tenant(name, digest.lower(), tuple(models), limits, admin, filters)


def _parse_text(text: str, source: str) -> list[Tenant]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeyFileError(f"{source}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"tenant"})
    if unknown:
        raise KeyFileError(f"{source}: unknown top-level key(s) {', '.join(unknown)}; use [[tenant]] tables")
    tables = data.get("tenant", [])
    if not isinstance(tables, list):
        raise KeyFileError(f"{source}: 'tenant' must be an array of tables ([[tenant]])")
    tenants = [_parse_tenant(f"{source}: tenant #{i + 1}", t) for i, t in enumerate(tables)]
    names: set[str] = set()
    hashes: set[str] = set()
    for t in tenants:
        if t.name in names:
            raise KeyFileError(f"{source}: tenant name {t.name!r} appears twice")
        if t.key_sha256 in hashes:
            # Two tenants with one key: authentication could not tell them apart.
            raise KeyFileError(f"{source}: tenant {t.name!r} has the same key_sha256 as another tenant")
        names.add(t.name)
        hashes.add(t.key_sha256)
    return tenants


def _read_file(path: Path) -> list[Tenant]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read keys file: {exc.strerror or exc}") from None
    return _parse_text(text, str(path))


class KeyStore:
    """The tenants the server knows, looked up by presented key."""

    def __init__(self, tenants: Iterable[Tenant], path: Path | None = None) -> None:
        self.path = path
        # Replaced as a whole by reload(); readers take one reference, so they never see a mix.
        self._tenants: tuple[Tenant, ...] = tuple(tenants)
        self._reload_lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KeyStore:
        path = Path(path)
        return cls(_read_file(path), path)

    @classmethod
    def single_key(cls, key: str) -> KeyStore:
        """The ``--api-key`` mode: one tenant, "default", unlimited, every model, admin."""
        if not key:
            raise ValueError("the API key must not be empty")
        return cls([Tenant("default", hash_key(key), ("*",), TenantLimits(), admin=True)])

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return self._tenants

    def get(self, name: str) -> Tenant | None:
        return next((t for t in self._tenants if t.name == name), None)

    def authenticate(self, presented_key: str | None) -> Tenant | None:
        """The tenant whose key this is, or None. Takes the same time whichever tenant matches."""
        if not presented_key:
            return None
        digest = hash_key(presented_key).encode("ascii")
        found: Tenant | None = None
        # Compare against every tenant, without stopping at a match, so the time taken says
        # nothing about which (or whether an early) tenant matched.
        for tenant in self._tenants:
            if hmac.compare_digest(digest, tenant.key_sha256.encode("ascii")) and found is None:
                found = tenant
        return found

    def allows_model(self, tenant: Tenant, model: str) -> bool:
        return "*" in tenant.models or model in tenant.models

    def reload(self) -> tuple[Tenant, ...]:
        """Re-read the keys file. A broken file keeps the current tenants and raises KeyFileError."""
        if self.path is None:
            return self._tenants  # --api-key mode: nothing to re-read
        with self._reload_lock:
            try:
                tenants = tuple(_read_file(self.path))
            except KeyFileError as exc:
                logger.error("keys file not reloaded, keeping %d tenant(s): %s", len(self._tenants), exc)
                raise
            self._tenants = tenants
        logger.info("keys file reloaded: %d tenant(s)", len(tenants))
        return tenants


def _toml_str(value: str) -> str:
    # JSON string escapes (\", \\, \n, \uXXXX) are valid in TOML basic strings.
    return json.dumps(value)


def add_key(
    path: str | os.PathLike[str],
    name: str,
    *,
    models: Sequence[str] | None = None,
    admin: bool = False,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    max_concurrent: int | None = None,
    daily_tokens: int | None = None,
) -> str:
    """Create a key for a new tenant, append the tenant (hash only) to the file, return the key.

    The file is created if missing; an existing tenant name is refused. The key is returned once
    and stored nowhere.
    """
    path = Path(path)
    existing = path.read_text(encoding="utf-8") if path.exists() else ""
    tenants = _parse_text(existing, str(path)) if existing.strip() else []
    if any(t.name == name for t in tenants):
        raise KeyFileError(f"{path}: tenant {name!r} already exists")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    lines = ["[[tenant]]", f"name = {_toml_str(name)}", f"key_sha256 = {_toml_str(hash_key(key))}"]
    lines.append(f"models = [{', '.join(_toml_str(m) for m in (models or ['*']))}]")
    limits = {
        "requests_per_minute": requests_per_minute,
        "tokens_per_minute": tokens_per_minute,
        "max_concurrent": max_concurrent,
        "daily_tokens": daily_tokens,
    }
    lines += [f"{k} = {v}" for k, v in limits.items() if v is not None]
    lines.append(f"admin = {'true' if admin else 'false'}")
    sep = "" if not existing else ("\n" if existing.endswith("\n") else "\n\n")
    text = existing + sep + "\n".join(lines) + "\n"
    # Validate the whole new file before it replaces the old one: a bad name or limit raises here.
    _parse_text(text, str(path))
    # Write-then-rename, so a server reloading at this moment reads the old or the new file whole.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return key
