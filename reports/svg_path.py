"""SVG path data in its short form: relative moves on a grid of a tenth of a point.

matplotlib writes every vertex absolutely with six decimals (``L 558.220624 134.198437``); a figure's lines and
error bars are most of its bytes. A tenth of a point is a seventh of a pixel at the size a report shows figures,
so coordinates are rounded to it, and each vertex is written as its step from the one before (``l.5-2.7``), a
repeated command letter left out, as the SVG path grammar allows. Steps are taken between rounded positions,
in whole tenths, so they add up to exactly the rounded absolute path: no error accumulates along a line.
"""

from __future__ import annotations

import re

#: A command letter or a number as matplotlib writes them (``%f``: no exponent).
_TOKEN = re.compile(r"[A-Za-z]|-?(?:\d+\.?\d*|\.\d+)")
#: Coordinate pairs each absolute command takes per segment.
_PAIRS = {"M": 1, "L": 1, "Q": 2, "C": 3}


def _tenths(value: int) -> str:
    """Whole tenths as the shortest number: 15 -> "1.5", 5 -> ".5", -5 -> "-.5", 20 -> "2"."""
    sign = "-" if value < 0 else ""
    whole, tenth = divmod(abs(value), 10)
    if not tenth:
        return f"{sign}{whole}"
    return f"{sign}{whole or ''}.{tenth}"


def _numbers(values: list[int]) -> str:
    """Numbers separated by a space, or by nothing where the next one's minus sign already separates them."""
    out = ""
    for v in values:
        text = _tenths(v)
        out += text if not out or text.startswith("-") else " " + text
    return out


def relative(d: str) -> str:
    """``d`` (absolute M, L, Q, C and z commands, as matplotlib writes them) in relative form.

    Anything else (an arc, a relative command, a malformed path) is returned as it came, never guessed at."""
    tokens = _TOKEN.findall(d)
    out: list[str] = []
    x = y = start_x = start_y = 0
    last = ""
    i = 0
    while i < len(tokens):
        command = tokens[i]
        i += 1
        if command in ("z", "Z"):
            out.append("z")
            x, y, last = start_x, start_y, "z"
            continue
        pairs = _PAIRS.get(command)
        if pairs is None:
            return d
        args = tokens[i:i + 2 * pairs]
        if len(args) < 2 * pairs or any(a.isalpha() for a in args):
            return d
        i += 2 * pairs
        points = [round(float(a) * 10) for a in args]
        steps = [p - (x if k % 2 == 0 else y) for k, p in enumerate(points)]
        letter = command.lower()
        # a letter is written only when it changes (after an "m", further pairs are implicitly "l")
        implicit = letter == last
        out.append(("" if implicit else letter) + _numbers(steps))
        if implicit and not out[-1].startswith("-"):
            out[-1] = " " + out[-1]
        x, y = points[-2], points[-1]
        if letter == "m":
            start_x, start_y = x, y
        last = "l" if letter == "m" else letter
    return "".join(out)
