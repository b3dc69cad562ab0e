"""Command-line value types with one-line errors (argparse reports them as the flag's error)."""

from __future__ import annotations

import argparse


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def filter_holdback(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected auto or a number of characters (0 or more), got {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def zero_is_none(value: float | int | None) -> float | int | None:
    """A limit where 0 means "none"."""
    return value or None
