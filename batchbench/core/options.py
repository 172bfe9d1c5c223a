"""Typed options: the dataclasses a command's parsed arguments are turned into once, so no
``argparse.Namespace`` travels below the command line."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class OptionGroup:
    """Base of the dataclasses that group options several commands share (:class:`EngineArgs`, ...): a command's
    options dataclass holds them as fields, which :func:`typed_options` fills from the same parsed values."""


def typed_options(cls: type[T], values: Mapping[str, Any]) -> T:
    """``cls``, a dataclass of one command's options, from the parsed arguments' values by field name: built once,
    so no ``argparse.Namespace`` travels further than the command line. A field that is itself such a dataclass
    (an :class:`OptionGroup`) is filled from the same values; a field the command did not register keeps its
    default."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = hints[f.name]
        if isinstance(tp, type) and issubclass(tp, OptionGroup):
            kwargs[f.name] = typed_options(tp, values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)
