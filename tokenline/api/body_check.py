"""Checks on a JSON request body as a whole, before its fields are validated.

JSON can spell a lone UTF-16 surrogate (``"\\ud800"``); Python decodes it into a string that is not
valid Unicode, which every later stage (the tokenizer, the ledger, the JSON encoder of a reply)
may choke on. It is the caller's mistake, so it is refused here with a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request

from tokenline.gateway.errors import APIError, shorten

__all__ = ["invalid_unicode_path", "reject_invalid_unicode"]

# json.loads joins a valid surrogate pair into one character, so any surrogate left is a lone one.
_SURROGATE = re.compile("[\ud800-\udfff]")


def invalid_unicode_path(data: Any, path: str = "") -> str | None:
    """The field (``messages[0].content``) of the first string in JSON data that holds a lone
    surrogate, or None. A bad object key names the object holding it."""
    if isinstance(data, str):
        return path if _SURROGATE.search(data) else None
    if isinstance(data, dict):
        for key, value in data.items():
            if _SURROGATE.search(key):
                return path
            found = invalid_unicode_path(value, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found = invalid_unicode_path(value, f"{path}[{i}]")
            if found is not None:
                return found
    return None


async def reject_invalid_unicode(request: Request) -> None:
    """A FastAPI dependency: a JSON body with invalid Unicode anywhere is a 400 naming the field.
    The body is the one FastAPI already read and parsed (Starlette caches both)."""
    if request.method not in ("POST", "PUT", "PATCH") or not await request.body():
        return
    try:
        data = await request.json()
    except (ValueError, json.JSONDecodeError):
        return  # not JSON: the body's own validation reports it
    path = invalid_unicode_path(data)
    if path is None:
        return
    where = shorten(path) if path else "the request body"
    raise APIError.bad_request(
        f"{where}: invalid Unicode (a lone surrogate such as \\ud800); text must be valid UTF-8",
        param=shorten(path) if path else None,
        code="invalid_unicode",
    )
