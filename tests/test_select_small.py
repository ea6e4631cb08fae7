"""select on small benchmarks (issue 54 item 5): `too_small`'s statement at select's defaults (margin 0.02, alpha
0.05) on AIME24's 30 problems and AMC23's 40, checked against the elimination itself (select_step)."""

from __future__ import annotations

import numpy as np
import pytest

from evaldag.decisions import select


def _figures(message: str) -> tuple[float, int, float]:
    """(the smallest margin, the problems a drop needs, the suggested margin) as the message states them."""
    need = float(message.split("no closer than ")[1].split(".", 1)[0] + "." + message.split("no closer than ")[1]
                 .split(".", 1)[1][:3])
    drop = int(message.split("beats it on at least ")[1].split()[0])
    suggested = float(message.split("--margin ")[1].split()[0])
    return need, drop, suggested


@pytest.mark.parametrize("benchmark, problems", [("AIME24", 30), ("AMC23", 40)])
@pytest.mark.parametrize("k", [2, 5, 20])
def test_too_smalls_figures_are_what_the_elimination_does(benchmark, problems, k):
    message = select.too_small(problems, k, margin=0.02, alpha=0.05, benchmark=benchmark)
    assert message is not None
    assert f"{benchmark} has {problems} problems" in message and f"show {k} checkpoints within margin 0.02" in message
    need, drop, suggested = _figures(message)
    looks = select.planned_looks(problems)
    same = {f"c{i}": np.ones(problems) for i in range(k)}
    # k checkpoints agreeing on every problem: equivalent at the stated margin, not just under it, nor at 0.02
    assert select.select_step(same, looks, 0.05, need + 1e-3, intervals=False).status == "equivalent"
    assert select.select_step(same, looks, 0.05, need - 1e-3, intervals=False).status != "equivalent"
    assert select.too_small(problems, k, margin=suggested) is None
    # a checkpoint the others beat on `drop` problems (and lose none) is dropped; on one fewer it stays in the set
    for p, dropped in ((drop, True), (drop - 1, False)):
        rows = dict(same)
        rows["c0"] = np.where(np.arange(problems) < p, 0.0, 1.0)
        sel = select.select_step(rows, looks, 0.05, 0.02, intervals=False)
        assert ("c0" not in sel.chosen) == dropped, (p, sel.status, sel.chosen)
    assert f"{drop / problems * 100:.0f} points" in message


def test_a_benchmark_large_enough_says_nothing_and_a_tiny_one_suggests_no_margin():
    assert select.too_small(500, 2, margin=0.05) is None
    tiny = select.too_small(3, 20, margin=0.5)
    assert tiny is not None and "--margin" not in tiny and "a larger benchmark" in tiny
