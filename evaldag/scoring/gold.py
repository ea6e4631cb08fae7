"""Each benchmark's gold answer as one canonical string, so that the cache key, the table and the grader all see the
same gold ("025" -> "25", "... #### 1,234" -> "1234", 27.0 -> "27"). A benchmark config names its gold's format."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Literal

GoldFormat = Literal["latex", "integer", "gsm8k", "number"]
GOLD_FORMATS: tuple[str, ...] = ("latex", "integer", "gsm8k", "number")

_INT_RE = re.compile(r"[+-]?\d+")
_NUMBER_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")


def _bad_gold(raw: object, fmt: str, expected: str) -> ValueError:
    return ValueError(f"cannot normalize gold {raw!r} as format {fmt!r}: expected {expected}")


def _canonical_number(d: Decimal) -> str:
    """27.0 -> "27", 0.50 -> "0.5", 1E+3 -> "1000": no exponent, no trailing zeros."""
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def normalize_gold(raw: object, fmt: GoldFormat) -> str:
    """Return the canonical gold string for a dataset's raw gold field.

    - ``latex`` (MATH-500, bare LaTeX such as ``\\frac{14}{3}``): the stripped string.
    - ``integer`` (AIME: ``"025"`` or ``25``): the integer without leading zeros (``"25"``, ``"000"`` -> ``"0"``).
    - ``gsm8k`` (a worked solution ending in ``#### 1,234``): the number after the last ``####`` without commas
      and spaces (``"1234"``); sign and decimals are kept.
    - ``number`` (AMC23: ``27.0``, ``0.5``, ``"3"``): the shortest plain decimal (``"27"``, ``"0.5"``).

    Raises ValueError, naming the value, the format and what was expected, when the value cannot be normalized:
    a gold we cannot read is a data error and must never be graded as a silent "wrong".
    """
    if fmt not in GOLD_FORMATS:
        raise ValueError(f"unknown gold format {fmt!r} for gold {raw!r}; expected one of {GOLD_FORMATS}")
    # bool is an int subclass; a True/False gold is always a data error, never the integer 1/0.
    if raw is None or isinstance(raw, bool):
        raise _bad_gold(raw, fmt, "a non-empty value")

    return _GOLD_NORMALIZERS[fmt](raw)


def _latex_gold(raw: object) -> str:
    if isinstance(raw, int) or (isinstance(raw, float) and math.isfinite(raw)):
        raw_s = _canonical_number(Decimal(repr(raw)))
    elif isinstance(raw, str):
        raw_s = raw.strip()
    else:
        raise _bad_gold(raw, "latex", "a LaTeX string")
    if not raw_s:
        raise _bad_gold(raw, "latex", "a non-empty LaTeX string")
    return raw_s


def _integer_gold(raw: object) -> str:
    if isinstance(raw, int):
        return str(raw)
    if isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
        return str(int(raw))
    if isinstance(raw, str) and _INT_RE.fullmatch(raw.strip()):
        return str(int(raw.strip()))  # int() drops leading zeros: "025" -> 25, "000" -> 0
    raise _bad_gold(raw, "integer", "an integer or a string of digits such as '025'")


def _gsm8k_gold(raw: object) -> str:
    if not isinstance(raw, str) or "####" not in raw:
        raise _bad_gold(raw, "gsm8k", "a GSM8K answer ending in '#### <number>'")
    tail = raw.rsplit("####", 1)[1]
    number = re.sub(r"[,\s]", "", tail)
    if not _NUMBER_RE.fullmatch(number):
        raise _bad_gold(raw, "gsm8k", f"a number after the last '####', found {tail.strip()!r}")
    return number.lstrip("+")


def _number_gold(raw: object) -> str:
    if isinstance(raw, int):
        return str(raw)
    if isinstance(raw, float):
        if not math.isfinite(raw):
            raise _bad_gold(raw, "number", "a finite number")
        # repr() is the shortest string that round-trips, so 0.1 stays "0.1" rather than 0.1000000000000000055...
        return _canonical_number(Decimal(repr(raw)))
    if isinstance(raw, str) and _NUMBER_RE.fullmatch(raw.strip().replace(",", "")):
        try:
            return _canonical_number(Decimal(raw.strip().replace(",", "")))
        except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
            pass
    raise _bad_gold(raw, "number", "a number such as 27.0, 0.5 or '3'")


_GOLD_NORMALIZERS = {"latex": _latex_gold, "integer": _integer_gold, "gsm8k": _gsm8k_gold, "number": _number_gold}
