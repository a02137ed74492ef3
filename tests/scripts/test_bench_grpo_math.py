"""scripts/bench/grpo_math.py: the rows and R4's verdict from hand-made runs (the runs themselves are the
benchmark's, minutes each)."""

import math

import pytest

from scripts.bench import grpo_math


def _run(key, seed, start, end, prompts=200):
    return {"key": key, "label": grpo_math.RUNTIMES[key][0], "seed": seed, "ok": True, "seconds": 60.0,
            "held_out": [{"step": 0, "greedy": start, "sampled": start - 0.1, "prompts": prompts},
                         {"step": 300, "greedy": end, "sampled": end - 0.1, "prompts": prompts}],
            "reward": [(10 * i, 0.3 + 0.01 * i) for i in range(1, 11)]}


def test_rows_judge_the_rise_and_the_agreement_by_standard_errors():
    runs = [_run("one", 1, 0.40, 0.60), _run("zeropp", 1, 0.40, 0.58),  # both rise, agree
            _run("one", 2, 0.40, 0.45), _run("zeropp", 2, 0.40, 0.44),  # no clear rise
            _run("one", 3, 0.40, 0.70), _run("zeropp", 3, 0.40, 0.50)]  # rises, but apart from one process
    rows = {(r["seed"], r["key"]): r for r in grpo_math.rows(runs)}
    se = math.hypot(math.sqrt(0.4 * 0.6 / 200), math.sqrt(0.58 * 0.42 / 200))
    assert rows[1, "zeropp"]["rise_se"] == se and rows[1, "zeropp"]["rose"] and rows[1, "zeropp"]["same"]
    flat = rows[2, "zeropp"]
    assert not flat["rose"] and flat["same"]
    assert rows[3, "zeropp"]["rose"] and not rows[3, "zeropp"]["same"]
    first, last = rows[1, "zeropp"]["train_first"], rows[1, "zeropp"]["train_last"]
    assert (first, last) == (pytest.approx(0.315), pytest.approx(0.395))  # fifths: 2 of the 10 logged rewards
    assert "same" not in rows[1, "one"]
    result = {"plan": {"seeds": [1, 2, 3], "steps": 300}, "nodes": 2, "ranks_per_node": 2, "rows": list(rows.values())}
    text = grpo_math.markdown(result)
    assert "R4 (not met)" in text and "on 2 of 3 seeds" in text and "of the one process's on 2 of 3" in text
    result["rows"] = grpo_math.rows(runs[:2])
    result["plan"]["seeds"] = [1]
    assert "R4 (met)" in grpo_math.markdown(result)
