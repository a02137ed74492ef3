"""Issue 34's benchmark (scripts/bench/autoplan.py) without running a job: A1's repeat and A1-A4 from hand-made
rows, against the ratios worked out by hand."""

import pytest

from scripts.bench import autoplan

BITS = {"ZeRO-3": 16, "ZeRO-3 + hpZ": 16, "ZeRO++ int4 weights": 4}
CONFIGS = {"ZeRO-3": ["--zero_optimization.stage", "3"], "ZeRO-3 + hpZ": ["--hpz"], "ZeRO++ int4 weights": ["--q4"],
           autoplan.AUTO: ["--plan.auto", "true"]}


def _row(name, step_ms, ok=True, **more):
    return {"name": name, "ok": ok, "step_ms": step_ms, "setting": "100mbit", "model": "gpt2-tiny",
            "micro_batch": 4, **more}


def _auto(step_ms, ok=True, plan_seconds=0.3, **more):
    plan = {"chosen": "ZeRO-3", "step_seconds": 0.099}
    return _row(more.pop("name", autoplan.AUTO), step_ms, ok, plan=plan, plan_seconds=plan_seconds, **more)


def test_the_repeat_runs_the_best_allowed_auto_and_zero3_each_at_the_same_mean_position():
    sweep = [_row("ZeRO-3", 110.0), _row("ZeRO-3 + hpZ", 100.0), _row("ZeRO++ int4 weights", 80.0), _auto(105.0)]
    repeat = autoplan.repeat_configs(sweep, CONFIGS, BITS)  # int4 weights are below the floor: not A1's best
    assert list(repeat) == ["repeat 1: ZeRO-3 + hpZ", "repeat 2: auto", "repeat 3: ZeRO-3", "repeat 4: ZeRO-3",
                            "repeat 5: auto", "repeat 6: ZeRO-3 + hpZ"]
    assert list(repeat.values()) == [["--hpz"], ["--plan.auto", "true"], ["--zero_optimization.stage", "3"],
                                     ["--zero_optimization.stage", "3"], ["--plan.auto", "true"], ["--hpz"]]
    zero3_best = [_row("ZeRO-3", 90.0)] + sweep[1:]  # ZeRO-3 is the best: run twice, not four times
    assert list(autoplan.repeat_configs(zero3_best, CONFIGS, BITS)) == [
        "repeat 1: ZeRO-3", "repeat 2: auto", "repeat 3: auto", "repeat 4: ZeRO-3"]
    assert autoplan.repeat_configs(sweep[:3] + [_auto(None, ok=False)], CONFIGS, BITS) == {}


def test_a1_and_a2_come_from_the_repeat_a3_and_a4_from_every_auto_run():
    sweep = [_row("ZeRO-3", 110.0), _row("ZeRO-3 + hpZ", 100.0), _row("ZeRO++ int4 weights", 80.0), _auto(105.0)]
    again = [_row("repeat 1: ZeRO-3 + hpZ", 104.0, repeat_of="ZeRO-3 + hpZ"),
             _auto(106.0, name="repeat 2: auto", repeat_of=autoplan.AUTO, plan_seconds=0.4),
             _row("repeat 3: ZeRO-3", 112.0, repeat_of="ZeRO-3"),
             _row("repeat 4: ZeRO-3", 114.0, repeat_of="ZeRO-3"),
             _auto(108.0, name="repeat 5: auto", repeat_of=autoplan.AUTO, plan_seconds=0.5),
             _row("repeat 6: ZeRO-3 + hpZ", 106.0, repeat_of="ZeRO-3 + hpZ")]
    cell, = autoplan.cells({"weight_bits": BITS, "rows": sweep + again})
    assert cell["best"] == "ZeRO-3 + hpZ" and cell["a1_sweep"] == pytest.approx(105 / 100)
    assert cell["a1"] == pytest.approx(107 / 105) and cell["a2"] == pytest.approx(107 / 113)
    assert cell["auto_runs"] == 3 and cell["a3"] == pytest.approx(99 / ((105 + 106 + 108) / 3))
    assert cell["a4"] == pytest.approx(400 / ((105 + 106 + 108) / 3)) and cell["choice"] == pytest.approx(110 / 100)
    no_repeat, = autoplan.cells({"weight_bits": BITS, "rows": sweep})
    assert no_repeat["a1"] is None and no_repeat["a1_sweep"] == pytest.approx(1.05)
    assert no_repeat["a2"] == pytest.approx(105 / 110) and no_repeat["a3"] == pytest.approx(99 / 105)
