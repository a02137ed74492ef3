"""Issue 33's benchmark (scripts/bench/diloco.py) without running a job: the target, the time to it and D1-D5
from hand-made rows, against the numbers worked out by hand."""

import pytest

from scripts.bench import diloco, suite


def _plan(**over):
    plan = diloco.resolve(suite.parser("diloco").parse_args(["--quick", "--out", "x"]))
    return {**plan, **over}


def _curve(key, points):
    return {"key": key, "label": key, "part": "curve", "setting": "loopback", "ok": True, "val_curve": points,
            "final_val_loss": points[-1][1]}


def _timed(key, setting, step_ms, phys=None, ledger=None, losses=(5.0, 4.0)):
    return {"key": key, "label": key, "part": "timed", "setting": setting, "ok": True, "step_ms": step_ms,
            "phys_tx_mb_node": phys, "ledger_cross_mb_rank": ledger, "losses": list(losses)}


def test_timed_segments_cover_whole_diloco_cycles():
    plan = _plan(warmup=2, inner_steps=25, cycles=2, timed_steps=4)
    assert diloco.timed_steps("diloco", plan) == 52 and diloco.timed_steps("zeropp", plan) == 6
    label, _, args = diloco.job("diloco", {**plan, "fragments": 4, "delay": 3})
    assert "4 fragments, delay 3" in label and args[-2:] == ["--diloco.delay", "3"]
    assert "--diloco.delay" not in diloco.job("diloco", plan)[2]  # absent unless asked for
    label, _, args = diloco.job("diloco", {**plan, "diloco_set": ["outer_momentum=0"]})
    assert "outer_momentum=0" in label and args[-2:] == ["--diloco.outer_momentum", "0"]


def test_target_time_to_it_and_d1_to_d5_by_hand():
    plan = _plan(slow="10mbit", target=None, margin=0.02, inner_steps=25)
    rows = [_curve("zero3", [(0, 8.0), (25, 5.0), (50, 4.0)]),  # target: max(4.0 x 1.02, bests 4.0, 4.1) = 4.1
            _curve("zeropp", [(0, 8.0), (25, 5.0), (50, 4.1)]),
            _curve("deepspeed", [(0, 8.0), (25, 4.9), (50, 4.0)]),
            _curve("diloco", [(0, 8.0), (25, 5.2), (50, 4.06)]),
            _timed("zeropp", "10mbit", 1000.0), _timed("deepspeed", "10mbit", 4000.0),
            _timed("ddp", "10mbit", 3000.0, phys=2.0, ledger=1.6),
            _timed("diloco", "10mbit", 110.0, phys=0.004, ledger=0.0019, losses=(5.0, 4.5)),
            _timed("diloco", "loopback", 100.0, losses=(5.0, 4.5))]
    result = {"plan": plan, "rows": rows}
    diloco.analyse(result)
    assert result["target"] == pytest.approx(4.1)
    steps = {r["key"]: r["step_to_target"] for r in rows if r["part"] == "curve"}
    # linear between evaluations: zero3 5.0 -> 4.0 over 25 steps reaches 4.1 at 25 + 25 x 0.9
    assert steps["zero3"] == pytest.approx(47.5) and steps["zeropp"] == pytest.approx(50.0)
    assert steps["deepspeed"] == pytest.approx(25 + 25 * 0.8 / 0.9)
    assert steps["diloco"] == pytest.approx(25 + 25 * 1.1 / 1.14)
    d = {t["id"]: t for t in result["targets"]}
    d1_phys, d1_ledger = [t for t in result["targets"] if t["id"] == "D1"]
    assert d1_phys["value"] == pytest.approx(0.004 / 1.0) and d1_phys["met"] is False  # 1/250 > 1/400
    assert d1_ledger["value"] == pytest.approx(0.0019 / 0.8) and d1_ledger["met"] is True  # 1/421
    diloco_s = (25 + 25 * 1.1 / 1.14) * 0.110
    assert d["D2"]["value"] == pytest.approx(50.0 * 1.0 / diloco_s) and d["D2"]["met"] is True
    assert d["D3"]["value"] == pytest.approx((25 + 25 * 0.8 / 0.9) * 4.0 / diloco_s)
    assert d["D4"]["value"] == pytest.approx(4.06 / 4.0) and d["D4"]["met"] is True  # +1.5%
    assert d["D5"]["value"] == pytest.approx(1.1) and d["D5"]["met"] is True
    assert d["D2 (deltas)"]["value"] is None  # not measured: no verdict
    assert result["same_losses"] == [{"key": "diloco", "setting": "10mbit", "steps": 2, "max_abs_diff": 0.0}]
    text = suite.markdown("diloco", {**result, "model": {"preset": "gpt2-tiny", "n_layer": 2, "d_model": 128,
                                                         "n_head": 4, "vocab_size": 2048, "params": 680000}}, {})
    assert "| D1 |" in text and "1/250" in text and "**no**" in text


def test_a_target_diloco_never_reaches_is_a_miss():
    plan = _plan(slow="10mbit", target=4.5)
    rows = [_curve("zero3", [(0, 8.0), (50, 4.0)]), _curve("diloco", [(0, 8.0), (50, 4.6)]),
            _timed("zeropp", "10mbit", 1000.0), _timed("diloco", "10mbit", 100.0)]
    result = {"plan": plan, "rows": rows}
    diloco.analyse(result)
    d = {t["id"]: t for t in result["targets"]}
    assert result["target"] == 4.5 and rows[1]["step_to_target"] is None
    assert d["D2"]["value"] is None and d["D2"]["met"] is False and "never reached" in d["D2"]["from"]
    assert d["D3"]["met"] is False  # a miss, not "not measured"


def test_skips_without_the_data(tmp_path):
    args = suite.parser("diloco").parse_args(["--quick", "--data", str(tmp_path / "missing.txt")])
    result = diloco.run(args, progress=lambda s: None)
    assert "not found" in result["skipped"] and "Skipped" in suite.markdown("diloco", result, {})
