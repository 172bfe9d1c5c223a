"""Each option is declared once, as a field of its command's options dataclass (batchbench.core.options): the parser
every command has is made from those fields, so what the parser defaults to is what the field says, and what it
parses comes back as the dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

from batchbench.cli import COMMANDS, parser
from batchbench.commands.bench import BenchArgs
from batchbench.commands.capacity import CapacityArgs
from batchbench.core.options import OptionGroup, typed_options
from batchbench.experiment.workload import WorkloadArgs


def _fields(cls: type[Any]) -> dict[str, dataclasses.Field[Any]]:
    """Every option field of ``cls``, its groups' included, by name."""
    found: dict[str, dataclasses.Field[Any]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if isinstance(hints[f.name], type) and issubclass(hints[f.name], OptionGroup):
            found |= _fields(hints[f.name])
        elif "batchbench.option" in f.metadata:
            found[f.name] = f
    return found


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_every_parser_default_is_its_fields(command: Any) -> None:
    actions = {a.dest: a for a in _subparser(command.name)._actions}
    for name, f in _fields(command.options).items():
        if name in command.leave_out:
            assert name not in actions
            continue
        action = actions[name]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            assert action.required or not action.option_strings, name  # a required option, or a positional
        elif name in command.required:
            assert action.required, name
        else:
            expected = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            assert action.default == expected, name


def _parsed(argv: list[str]) -> Any:
    values = vars(parser().parse_args(argv))
    return typed_options(values.pop("options"), values)


def test_parsed_values_come_back_typed_with_the_fields_defaults() -> None:
    args = _parsed(["bench", "--concurrency", "4,1", "--stop-on-error", "--results-dir", "out"])
    assert isinstance(args, BenchArgs)
    assert args.concurrency == (1, 4) and args.stop_on_error is True and args.rate is None
    assert args.engine.results_dir == Path("out") and args.engine.launch == "auto"
    assert args.workload == WorkloadArgs()  # every workload option not given: its field's default
    assert _parsed(["bench", "--keep-going"]).stop_on_error is False


@pytest.mark.parametrize("argv", [
    ["bench", "--stop-on-error", "--keep-going"],          # a flag and its negation exclude each other
    ["bench", "--concurrency", "1", "--rate", "2"],       # so do the two kinds of level
    ["capacity", "--stages", "rate=2:10s"],               # left out of capacity
    ["capacity"],                                          # --slo, optional for bench, is required here
    ["run", "--dataset", "x.jsonl"],                       # refused by the main job, naming why
])
def test_what_a_command_does_not_take_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip()


def test_capacity_requires_the_slo_bench_takes_optionally() -> None:
    assert isinstance(_parsed(["capacity", "--slo", "ttft_p99=1s"]), CapacityArgs)
    assert _parsed(["bench"]).workload.slo is None
