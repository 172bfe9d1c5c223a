"""The rules an option's text is read by: each turns the user's text into a value or raises argparse's usage error,
which names the text, so a bad option stops a command in its first second. Used as an :func:`option`'s ``type``."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _read(text: str, convert: Callable[[str], T], expected: str) -> T:
    """``convert(text)``, or argparse's usage error saying what was expected instead of the text."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}") from None


def positive_int(text: str) -> int:
    value = _read(text, int, "a whole number")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _read(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def positive_seconds(text: str) -> float:
    value = _read(text, float, "a number of seconds")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def positive_number(text: str) -> float:
    """A number more than 0 (a level, a gamma shape, a tolerance)."""
    value = _read(text, float, "a number")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number more than 0, not {text}")
    return value


def share(text: str) -> float:
    """``5%`` or ``0.05`` -> 0.05: a precision target, more than 0 and below 1."""
    value = _read(text, lambda t: float(t[:-1]) / 100 if t.endswith("%") else float(t), "a share such as 5% or 0.05")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and less than 100%, not {text}")
    return value


def concurrency_list(text: str) -> tuple[int, ...]:
    """``1,2,4`` -> (1, 2, 4): distinct levels of at least 1, in increasing order (every command's batch sizes)."""
    levels: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers separated by commas, e.g. 1,4,16") \
                from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a concurrency must be at least 1, not {value}")
        levels.add(value)
    if not levels:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers separated by commas, e.g. 1,4,16")
    return tuple(sorted(levels))


def rate_list(text: str) -> list[float]:
    """``2,8,inf`` -> levels in requests/s; each more than 0 (``inf``: every request at once)."""
    levels = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected requests/s separated by commas, e.g. 2,8,inf") \
                from None
        if math.isnan(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: a rate must be more than 0 requests/s, not {part.strip()}")
        levels.append(value)
    return levels


def parsed_by(source: Any) -> Callable[[str], Any]:
    """An argparse type from a class's ``parse`` classmethod (``Slo``, ``Lengths``) or a parse function: its
    ValueError, which names the user's text, becomes argparse's usage error."""
    parse = getattr(source, "parse", source)

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = source.__name__.lower()
    return convert
