"""Step validity: find the arithmetic steps a completion states and check each one.

A step is an equality whose two sides are both arithmetic on numbers: `12 * 4 = 48`, `\\frac{3}{4} \\cdot 8 = 6`,
GSM8K's calculator annotations `<<48/2=24>>`, and each neighbouring pair of a chain `a = b = c`. An equality with a
variable or a word glued to a side (`x = 5`, `2x + 3 = 11`, `f(2) = 5`, `20% of 50 = 10`) is no arithmetic step and
is not counted; nor is `number = number` with no operation on either side (a unit conversion such as `1 = 100`).

Checking is exact: each side is parsed by Python's `ast` (parsing runs no code) and the tree is evaluated node by
node with sympy numbers, allowing only + - * / ^, unary minus, sqrt, pi and numeric literals; powers too large to
compute are not checkable. A side written as a bare decimal is taken as rounded to its digits (`10/3 = 3.33` is
valid); an integer is taken as rounded only against an irrational side (`\\pi \\cdot 10^2 = 314`).

evaldag.scoring.grading.check_many runs `count_steps` in grading's process pool with the same hard per-item
timeout: an item that overruns gets (None, None), unscored rather than faked.
"""

from __future__ import annotations

import ast
import math
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

log = logging.getLogger(__name__)

# The characters an arithmetic side is made of, after normalisation (√ and π stand for sqrt and pi).
_ARITH = set("0123456789.+-*/^()% \t√π")
_OPERATORS = set("+-*/^%√")
# A word before or after a side that makes it part of a longer expression: `20% of 50 = 10` is not `50 = 10`.
_ARITH_WORDS = frozenset({"of", "times", "plus", "minus", "divided", "multiplied", "over", "squared", "cubed", "x"})
# Characters that may touch a side without a space and still end it (a quote, a bracket, punctuation).
_CLEAN_BEFORE = set("\"'[")
_CLEAN_AFTER = set(",;:!?\"']}")
_WORD_BEFORE = re.compile(r"([^\W\d]+)[ \t]*$")
_WORD_AFTER = re.compile(r"\s*(\w+)")
_MIXED_AFTER = re.compile(r"\s*and\s+(\d+)\s*/\s*(\d+)(?!\s*[-+*/^=])")
# 2 ** this many bits: the largest power evaluated exactly (larger ones are not checkable).
_MAX_POWER_BITS = 100_000


@dataclass(frozen=True)
class Step:
    """One checked step: its two sides as found (normalised) and whether they are equal."""

    lhs: str
    rhs: str
    valid: bool


# ------------------------------------------------------------------------------------------------------------------
# Normalising LaTeX and plain text to one arithmetic notation
# ------------------------------------------------------------------------------------------------------------------

def _braced(text: str, i: int) -> tuple[str, int] | None:
    """The content of the {...} group (or the single character) at text[i], and the index after it."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        return text[i], i + 1
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j], j + 1
    return None


def _replace_commands(text: str, pattern: str, arity: int, build: Any) -> str:
    """Replace every `\\command{a}{b}` matching `pattern` with `build(a, b)`, innermost groups included."""
    out, pos = [], 0
    for m in re.finditer(pattern, text):
        if m.start() < pos:
            continue
        args, i = [], m.end()
        for _ in range(arity):
            got = _braced(text, i)
            if got is None:
                break
            args.append(got[0])
            i = got[1]
        if len(args) < arity:
            continue
        out.append(text[pos:m.start()])
        out.append(build(*[_latex(a) for a in args], m))
        pos = i
    out.append(text[pos:])
    return "".join(out)


_SIMPLE = [(r"\\left|\\right|\\displaystyle", ""), (r"\\(?:cdot|times|ast)(?![a-zA-Z])", "*"),
           (r"\\div(?![a-zA-Z])", "/"), (r"\\pi(?![a-zA-Z])", "π"), (r"\\%", "%"), (r"\{,\}", ""),
           (r"\\[,;:! ]|~|\\q?quad(?![a-zA-Z])", " "), (r"\\\[|\\\]|\\\(|\\\)|\$", " "),
           (r"\\[a-zA-Z]+", " ¦ "), (r"\{", "("), (r"\}", ")")]


def _latex(text: str) -> str:
    """LaTeX math to plain arithmetic: fractions, roots, powers, operators; other commands become a separator."""
    text = re.sub(r"(\d+)\s*(\\[dt]?frac\s*\{\d+\}\s*\{\d+\})", r"(\1+\2)", text)   # a mixed number: 2\frac{1}{2}
    text = _replace_commands(text, r"\\[dt]?frac(?![a-zA-Z])", 2, lambda a, b, m: f"(({a})/({b}))")
    text = _replace_commands(text, r"\\sqrt\s*\[([^\]]*)\]", 1, lambda a, m: f"(({a})^(1/({m.group(1)})))")
    text = _replace_commands(text, r"\\sqrt(?![a-zA-Z])", 1, lambda a, m: f"√({a})")
    text = _replace_commands(text, r"\\(?:text|textbf|mathrm|mbox|operatorname)(?![a-zA-Z])", 1,
                             lambda a, m: f" {a} ")
    text = _replace_commands(text, r"\\boxed(?![a-zA-Z])", 1, lambda a, m: f" {a} ")
    for pattern, repl in _SIMPLE:
        text = re.sub(pattern, repl, text)
    return text


def normalize(text: str) -> str:
    """A completion in one plain arithmetic notation: GSM8K annotations on lines of their own, LaTeX rewritten,
    × ÷ · and `12 x 4` as * and /, markdown bold and thousands separators gone."""
    text = re.sub(r"<<([^<>]*)>>", r"\n\1\n", text or "")
    text = _latex(text.replace("\\\\", "\n").replace("&", ""))
    text = text.replace("×", "*").replace("·", "*").replace("⋅", "*").replace("÷", "/").replace("−", "-")
    text = text.replace("**", " ")
    text = re.sub(r"(?<=\d)[ \t]*[xX][ \t]*(?=\d)", "*", text)
    text = re.sub(r"\.(?=\s|$)", " ¦ ", text)           # a sentence's end: `12*4=48. 5+5=10` is two steps
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)


# ------------------------------------------------------------------------------------------------------------------
# Finding steps
# ------------------------------------------------------------------------------------------------------------------

def _balance(side: str) -> str:
    """Drop an unbalanced leading '(' or trailing ')' (a step written inside parentheses) and a sentence's period."""
    side = side.strip().rstrip(".").strip()
    while side.startswith("(") and side.count("(") > side.count(")"):
        side = side[1:].strip()
    while side.endswith(")") and side.count(")") > side.count("("):
        side = side[:-1].strip()
    return side


def _left_side(text: str, eq: int) -> str | None:
    """The arithmetic side ending at the '=' at text[eq], or None where it is no clean side."""
    start = eq
    while start > 0 and text[start - 1] in _ARITH:
        start -= 1
    span = text[start:eq]
    side = _balance(span)
    if not re.search(r"[\dπ]", side) or side[0] in "+*/^)%" or side.startswith("- "):
        return None
    before = text[start - 1] if start > 0 else "\n"
    if before not in "\n=" and not span[:1].isspace() and before not in _CLEAN_BEFORE:
        return None        # glued to a word or symbol: `f(2) = 5`, `3:30 = 3.5`
    word = _WORD_BEFORE.search(text[max(0, start - 40):start])     # a window: the whole prefix is quadratic
    if word and re.fullmatch(r"[\d.]+", side):
        return None        # a label, not a result: `Week 2 = 35 + 35`
    return None if word and word.group(1).lower() in _ARITH_WORDS else side


def _right_side(text: str, eq: int) -> tuple[str | None, int]:
    """The arithmetic side starting after the '=' at text[eq] (None where it is no clean side), and where it ends."""
    end = eq + 1
    while end < len(text) and text[end] in _ARITH:
        end += 1
    span = text[eq + 1:end]
    side = _balance(span)
    if not re.search(r"[\dπ]", side) or side[-1] in "+-*/^(√":
        return None, end
    after = text[end] if end < len(text) else "\n"
    if after not in "\n=" and not span[-1:].isspace() and after not in _CLEAN_AFTER:
        return None, end   # glued to a word: `= 5x`
    mixed = _MIXED_AFTER.match(text, end)
    if mixed and int(mixed.group(1)) < int(mixed.group(2)):
        return None, end   # a mixed number: `4 / 3 = 1 and 1/3`
    word = _WORD_AFTER.match(text, end)
    return (None if word and word.group(1).lower() in _ARITH_WORDS else side), end


def find_steps(completion: str) -> list[tuple[str, str]]:
    """The arithmetic steps (lhs, rhs) a completion states, each distinct step once, in order of appearance."""
    text = normalize(completion)
    steps, seen, previous = [], set(), (None, 0)
    for m in re.finditer(r"(?<![<>!=])=(?![=>])", text):
        lhs, (rhs, end) = _left_side(text, m.start()), _right_side(text, m.start())
        if lhs is None and not text[previous[1]:m.start()].strip():
            lhs = previous[0]      # an aligned chain goes on at the next line's '=' (`y &= 3 \cdot 4 \\ &= 12`)
        previous = (rhs, end)
        if lhs is None or rhs is None:
            continue
        if not any(c in _OPERATORS for c in lhs.lstrip("-") + rhs.lstrip("-")):
            continue       # `3 = 3`: no operation, no step
        key = (lhs.replace(" ", ""), rhs.replace(" ", ""))
        if key not in seen:
            seen.add(key)
            steps.append((lhs, rhs))
    return steps


# ------------------------------------------------------------------------------------------------------------------
# Checking steps
# ------------------------------------------------------------------------------------------------------------------

class _NotCheckable(Exception):
    pass


@lru_cache(maxsize=1)
def _sympy() -> Any:
    import sympy

    return sympy


def _python(side: str) -> str:
    side = re.sub(r"(?<![\d.])0+(?=\d)", "", side)      # `05` (Python's parser refuses leading zeros)
    side = re.sub(r"(\d+(?:\.\d+)?|\.\d+)\s*%", r"(\1/100)", side)
    side = re.sub(r"(?<=[\d)π])\s*(?=[(√π])", "*", side)     # implicit products: 2(3+4), 2π, 2√(2)
    side = re.sub(r"(?<=\))\s*(?=[\d.])", "*", side)
    return side.replace("^", "**").replace("√", "sqrt").replace("π", "pi")


def _value(node: ast.AST) -> Any:
    """Evaluate an ast node with sympy numbers; only arithmetic nodes are allowed."""
    sp = _sympy()
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return sp.Integer(node.value) if isinstance(node.value, int) else sp.Rational(repr(node.value))
    if isinstance(node, ast.Name) and node.id == "pi":
        return sp.pi
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sqrt"
            and len(node.args) == 1 and not node.keywords):
        return sp.sqrt(_value(node.args[0]))
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            size = abs(float(b)) * max(1.0, math.log2(abs(float(a)) + 2))
            if size > _MAX_POWER_BITS:
                raise _NotCheckable("power too large")
            return a ** b
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise _NotCheckable("division by zero")
            return a / b
        return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
    raise _NotCheckable(f"not arithmetic: {ast.dump(node)[:60]}")


def evaluate(side: str) -> Any:
    """The exact sympy value of an arithmetic side, or None where it is not checkable."""
    try:
        value = _value(ast.parse(_python(side), mode="eval"))
    except (SyntaxError, _NotCheckable, ValueError, TypeError, RecursionError, OverflowError, ZeroDivisionError):
        return None
    return value if value.is_finite and value.is_real is not False else None


def _rounding(side: str, other: Any) -> float:
    """How far a side written as a bare number may be from the exact value and still be that value rounded."""
    m = re.fullmatch(r"-?\d*(?:\.(\d+))?\s*(%?)", side.strip())
    if m is None:
        return 0.0
    scale = 0.01 if m.group(2) else 1.0        # `33.33%` is rounded to hundredths of a percent
    if m.group(1):
        return 0.5 * 10.0 ** -len(m.group(1)) * scale * (1 + 1e-9)
    return 0.5 * scale if not other.is_rational else 0.0


def check_step(lhs: str, rhs: str) -> bool | None:
    """Whether lhs equals rhs (within the rounding a bare decimal side states); None where either is not checkable,
    or where a side is irrational and beyond the float range (its tolerance, relative to its size, would be inf)."""
    sp = _sympy()
    a, b = evaluate(lhs), evaluate(rhs)
    if a is None or b is None:
        return None
    tol = max(_rounding(lhs, b), _rounding(rhs, a))
    if a.is_Rational and b.is_Rational:     # the common case, exact and fast
        return bool(a == b or abs(a - b) <= sp.Rational(tol))
    diff = abs(sp.N(a - b, 40))
    scale = max(1.0, abs(float(sp.N(a))), abs(float(sp.N(b))))
    if math.isinf(scale):       # beyond the float range the tolerance would be inf too, and every step valid
        return None
    return bool(diff <= max(tol, 1e-12 * scale))


def check_steps(completion: str) -> list[Step]:
    """Every checkable step of a completion with its verdict."""
    out = []
    for lhs, rhs in find_steps(completion):
        valid = check_step(lhs, rhs)
        if valid is not None:
            out.append(Step(lhs, rhs, valid))
    return out


def count_steps(completion: str) -> tuple[int, int]:
    """(steps checked, steps valid) of one completion."""
    steps = check_steps(completion)
    return len(steps), sum(s.valid for s in steps)
