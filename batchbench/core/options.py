"""Typed options, each declared once: a dataclass field says an option's flags, type, rule, default and help, and
both the command line's parser and the typed value it is read into are made from it.

A command's options are a frozen dataclass whose fields are :func:`option` fields (or groups of them, an
:class:`OptionGroup` several commands share). :func:`add_options` registers them with argparse, or with a pytest
option group, which takes the same keywords; :func:`typed_options` turns the parsed values back into the
dataclass, so no ``argparse.Namespace`` travels below the command line. Written here rather than taken from a
library (tyro, simple-parsing): those name a nested group's options by its path (``--engine.model``), and
batchbench's flags, which users and CI scripts already type, stay as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

#: The field metadata key an option's declaration is kept under.
_KEY = "batchbench.option"


class OptionGroup:
    """Base of the dataclasses that group options several commands share (:class:`EngineArgs`, ...): a command's
    options dataclass holds them as fields, which :func:`add_options` registers and :func:`typed_options` fills
    from the same parsed values."""


@dataclass(frozen=True)
class Flag:
    """An option's declaration, less its default (the field's own)."""

    #: ``--name`` (and aliases), or one bare name for a positional argument.
    flags: tuple[str, ...]
    #: A function where the text depends on what is registered when the parser is built (the engines).
    help: str | Callable[[], str]
    #: argparse's keywords beyond these: ``type`` (the rule), ``choices`` (or a function that lists them when the
    #: parser is built), ``metavar``, ``action``.
    keywords: Mapping[str, Any]
    #: Options of one command with the same name here exclude each other (argparse's mutually exclusive group).
    exclusive: str | None = None
    #: A second flag that sets the field to False (``--keep-going`` beside ``--stop-on-error``), with its help.
    negation: tuple[str, str] | None = None

    @property
    def positional(self) -> bool:
        return not self.flags[0].startswith("-")


def option(*flags: str, help: str | Callable[[], str], default: Any = None,
           default_factory: Any = dataclasses.MISSING, exclusive: str | None = None,
           negation: tuple[str, str] | None = None, **keywords: Any) -> Any:
    """A dataclass field that is also a command-line option (default None: not given). A positional argument (a
    bare name) and an option with ``required=True`` have no default. ``%(default)s`` in ``help`` shows the field's
    default, so the value is written once."""
    flag = Flag(flags, help, keywords, exclusive, negation)
    meta = {_KEY: flag}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    if flag.positional or keywords.get("required"):
        return field(metadata=meta)
    return field(default=default, metadata=meta)


def add_options(target: Any, cls: type[Any], *, leave_out: Collection[str] = (),
                required: Collection[str] = ()) -> None:
    """Register every option of ``cls`` (a dataclass of :func:`option` fields and :class:`OptionGroup` fields) with
    ``target``: an ``argparse.ArgumentParser`` (its ``add_argument``) or a pytest option group (``addoption``).
    ``leave_out``: fields this command does not take; ``required``: optional ones it requires."""
    add = target.add_argument if hasattr(target, "add_argument") else target.addoption
    groups: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and issubclass(tp, OptionGroup):
            add_options(target, tp, leave_out=leave_out, required=required)
            continue
        flag: Flag | None = f.metadata.get(_KEY)
        if flag is None or f.name in leave_out:
            continue
        here = add
        if flag.exclusive is not None or flag.negation is not None:
            key = flag.exclusive or f.name
            if key not in groups:
                groups[key] = target.add_mutually_exclusive_group()
            here = groups[key].add_argument
        keywords = dict(flag.keywords)
        if callable(keywords.get("choices")):
            keywords["choices"] = keywords["choices"]()
        text = flag.help() if callable(flag.help) else flag.help
        if flag.positional:
            here(*flag.flags, help=text, **keywords)
            continue
        if f.name in required:
            keywords["required"] = True
        elif not keywords.get("required"):
            keywords["default"] = _default(f)
        here(*flag.flags, dest=f.name, help=text, **keywords)
        if flag.negation is not None:
            negated, why = flag.negation
            # The same default as the flag's: argparse's store_false would default to True, and only the order of
            # the two actions would keep it from showing.
            here(negated, dest=f.name, action="store_false", default=keywords.get("default"), help=why)


def _default(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (a fresh one from its factory), or MISSING."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


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


@dataclass(frozen=True)
class Command:
    """One ``batchbench`` subcommand: its name, its options' dataclass and the function that runs it, for the one
    module that builds the parser (:mod:`batchbench.cli`)."""

    name: str
    #: The line ``batchbench --help`` lists it with; its module's docstring is its own ``--help``.
    summary: str
    description: str | None
    options: type[Any]
    main: Callable[[Any], int]
    #: Options of other commands refused with why (a usage error naming where they belong).
    refused: Mapping[tuple[str, ...], str] = field(default_factory=dict)
    #: Fields of ``options``' groups this command does not take, and optional ones it requires.
    leave_out: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    #: Keep the description's line breaks (a docstring laid out as paragraphs and lists).
    raw_description: bool = True

    def register(self, sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
        formatter = argparse.RawDescriptionHelpFormatter if self.raw_description else argparse.HelpFormatter
        parser: argparse.ArgumentParser = sub.add_parser(self.name, help=self.summary, description=self.description,
                                                         formatter_class=formatter)
        add_options(parser, self.options, leave_out=self.leave_out, required=self.required)
        for flags, why in self.refused.items():
            for name in flags:
                parser.add_argument(name, action=NotForThisCommand, dest=f"_not_{name.strip('-')}", why=why)
        parser.set_defaults(handler=self.main, options=self.options)
        return parser


class NotForThisCommand(argparse.Action):
    """An option another command takes, given to this one: a usage error that says why and where it belongs, rather
    than argparse's "unrecognized arguments"."""

    def __init__(self, option_strings: list[str], dest: str, why: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string or self.option_strings[0]} {self.why}")
