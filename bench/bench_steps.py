"""Step validity (evaldag.scoring.steps) against a truth set: precision and recall of "invalid step", and its cost.

The truth set: GSM8K's training solutions carry calculator annotations `<<a=b>>`, valid by construction; a share of
them is corrupted (the result, in the annotation and in the text after it, made off by one, ten times too large, or
with two digits swapped) to make invalid ones. A step counts as found invalid where the checker flags a step with the
annotation's left side; an annotation that is no checkable step on its own (`<<7=7>>`) is left out of the truth.
Beside it, the hand-written MATH-style cases of tests/cases/step_cases.json (step counts per case).
Cost: CPU seconds of this process per 1,000 completions (time.process_time, so other load on the machine does not
count), one process, no pool.

    python bench/bench_steps.py [--solutions 2000] [--share 0.3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the project (not _common: tests import this file)

from evaldag.scoring.steps import check_steps, count_steps, find_steps

HERE = Path(__file__).resolve().parent
GSM8K_TRAIN = HERE.parent.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
HAND_CASES = HERE.parent / "tests" / "cases" / "step_cases.json"
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>=]*)>>")


def _text(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.10g}"


def corrupt_result(result: str, rng: random.Random) -> str | None:
    """A wrong result in place of `result`: off by one (in its last digit), ten times too large, or two digits
    swapped; None where `result` is no number."""
    try:
        value = Fraction(result.strip())
    except (ValueError, ZeroDivisionError):
        return None
    digits = result.strip().split(".")[1] if "." in result else ""
    unit = Fraction(1, 10 ** len(digits))
    kinds = {"off_by_one": _text(value + rng.choice([unit, -unit])), "times_ten": _text(value * 10)}
    chars = list(result.strip())
    pairs = [i for i in range(len(chars) - 1) if chars[i].isdigit() and chars[i + 1].isdigit()
             and chars[i] != chars[i + 1] and not (i == 0 and chars[1] == "0")]    # no leading zero
    if pairs:
        i = rng.choice(pairs)
        chars[i], chars[i + 1] = chars[i + 1], chars[i]
        kinds["digit_swap"] = "".join(chars)
    wrong = kinds[rng.choice(sorted(kinds))]
    return wrong if Fraction(wrong) != value else None


def _step_key(lhs: str, rhs: str) -> str | None:
    """The checker's left side of an annotation on its own; None where it finds no step there."""
    found = find_steps(f"<<{lhs}={rhs}>>")
    return found[0][0].replace(" ", "") if found else None


def gsm8k_truth(solutions: list[str], share: float, seed: int) -> list[tuple[str, dict[str, bool]]]:
    """(solution text with a `share` of its annotations corrupted, {annotation's step key: corrupted}) per solution."""
    rng = random.Random(seed)
    out = []
    for text in solutions:
        pieces, truth, pos = [], {}, 0
        for m in _ANNOTATION.finditer(text):
            lhs, rhs = m.group(1), m.group(2)
            key = _step_key(lhs, rhs)
            wrong = corrupt_result(rhs, rng) if key is not None and rng.random() < share else None
            pieces.append(text[pos:m.start()])
            pos = m.end()
            if wrong is not None:
                pieces.append(f"<<{lhs}={wrong}>>")
                if text.startswith(rhs, pos):     # the text repeats the result after the annotation
                    pieces.append(wrong)
                    pos += len(rhs)
            else:
                pieces.append(m.group(0))
            if key is not None:
                truth[key] = truth.get(key, False) or wrong is not None
        pieces.append(text[pos:])
        out.append(("".join(pieces), truth))
    return out


def score_truth(truth_set: list[tuple[str, dict[str, bool]]]) -> dict[str, float]:
    """Precision and recall of "invalid step" over the annotations, and how many were not found at all."""
    tp = fp = fn = missed = total = 0
    for text, truth in truth_set:
        flagged: dict[str, bool] = {}
        for step in check_steps(text):
            key = step.lhs.replace(" ", "")
            flagged[key] = flagged.get(key, False) or not step.valid
        for key, corrupted in truth.items():
            total += 1
            missed += key not in flagged
            found_invalid = flagged.get(key, False)
            tp += corrupted and found_invalid
            fp += (not corrupted) and found_invalid
            fn += corrupted and not found_invalid
    return {"annotations": total, "invalid": tp + fn, "tp": tp, "fp": fp, "fn": fn, "not_found": missed,
            "precision": tp / (tp + fp) if tp + fp else float("nan"), "recall": tp / (tp + fn) if tp + fn else float("nan")}


def score_hand(cases: list[dict]) -> dict[str, float]:
    """Per-case step counts against the hand cases; precision and recall of invalid steps from the counts."""
    tp = fp = fn = exact = 0
    for case in cases:
        checked, valid = count_steps(case["completion"])
        got, want = checked - valid, case["checked"] - case["valid"]
        tp, fp, fn = tp + min(got, want), fp + max(0, got - want), fn + max(0, want - got)
        exact += (checked, valid) == (case["checked"], case["valid"])
    return {"cases": len(cases), "exact": exact, "tp": tp, "fp": fp, "fn": fn,
            "precision": tp / (tp + fp) if tp + fp else float("nan"), "recall": tp / (tp + fn) if tp + fn else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--solutions", type=int, default=2000)
    parser.add_argument("--share", type=float, default=0.3, help="share of annotations corrupted")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [json.loads(line) for line in GSM8K_TRAIN.read_text().splitlines()[: args.solutions]]
    truth_set = gsm8k_truth([r["answer"] for r in rows], args.share, args.seed)
    count_steps("12 * 4 = 48")     # sympy's import is not the steps' cost
    t0 = time.process_time()
    steps = sum(count_steps(text)[0] for text, _ in truth_set)
    cpu = time.process_time() - t0
    gsm = score_truth(truth_set)
    hand = score_hand(json.loads(HAND_CASES.read_text())["cases"])
    print(f"GSM8K train, first {len(rows)} solutions, {args.share:.0%} of annotations corrupted (seed {args.seed}):")
    print(f"  annotations {gsm['annotations']}, invalid {gsm['invalid']}; found invalid: tp {gsm['tp']} fp {gsm['fp']} "
          f"fn {gsm['fn']}; not found at all {gsm['not_found']}")
    print(f"  precision {gsm['precision']:.4f}  recall {gsm['recall']:.4f}")
    print(f"hand-written cases: {hand['exact']}/{hand['cases']} exact step counts; invalid steps tp {hand['tp']} "
          f"fp {hand['fp']} fn {hand['fn']}; precision {hand['precision']:.3f} recall {hand['recall']:.3f}")
    print(f"cost: {cpu:.2f} CPU s for {len(truth_set)} completions ({steps} steps checked) = "
          f"{1000 * cpu / len(truth_set):.2f} CPU s per 1,000 completions "
          f"({1e3 * cpu / max(steps, 1):.2f} ms per step)")


if __name__ == "__main__":
    main()
