"""The command line that made a run, as a user can type it again, with its secrets left out.

Recorded in every results document's environment (:func:`batchbench.core.environment.capture`), so a report can
say the exact command that reproduces it. A value that may be a secret never gets there: the value of an option
whose name looks like one (``--api-key``), a header whose name does (``--header "Authorization: Bearer ..."``),
and the user and password of a URL.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

#: Names whose values are never shown (environment variables, options, headers).
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API[_-]?KEY|AUTH", re.IGNORECASE)
REDACTED = "***"
#: ``scheme://user:password@host``: the part before the ``@``.
_USERINFO = re.compile(r"(://)[^/@\s]+@")
#: Options whose value is a header, ``Name: value``.
_HEADER_OPTIONS = ("--header", "-H")


def is_secret_name(name: str) -> bool:
    """Whether a variable, option or header of this name holds a secret."""
    return SECRET_NAME.search(name) is not None


def _value(option: str, value: str) -> str:
    if option in _HEADER_OPTIONS:
        name, sep, _ = value.partition(":")
        return f"{name}{sep} {REDACTED}" if sep and is_secret_name(name) else value
    return REDACTED if is_secret_name(option) else _USERINFO.sub(rf"\1{REDACTED}@", value)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with every secret value replaced by :data:`REDACTED` (module docstring)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        before = argv[i - 1] if i else ""
        if arg.startswith("-") and "=" in arg:
            option, _, value = arg.partition("=")
            out.append(f"{option}={_value(option, value)}")
        elif before.startswith("-") and "=" not in before and not arg.startswith("-"):
            out.append(_value(before, arg))
        else:
            out.append(_USERINFO.sub(rf"\1{REDACTED}@", arg))
    return out


def invocation(argv: Sequence[str] | None = None) -> str:
    """The command as typed: the program by its name (``batchbench``, ``pytest``: ``python -m X`` and the console
    script alike), then its arguments with secrets redacted, quoted for a shell."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    first = Path(argv[0])
    program = first.parent.name if first.name == "__main__.py" else first.name
    return shlex.join([program, *redact_argv(argv[1:])])
