"""scripts/bench/fewer_bits.py without training: the held-out corpus it writes and the F1-F4 verdicts it draws."""

import gzip
import json

import pytest

from scripts.bench import convergence, fewer_bits


def test_the_corpus_is_every_chosen_dialogue(tmp_path):
    if not fewer_bits.HH.is_file():
        pytest.skip(f"{fewer_bits.HH} not found")
    text = fewer_bits.corpus(tmp_path).read_text()
    with gzip.open(fewer_bits.HH, "rt") as f:
        chosen = [json.loads(line)["chosen"].strip() for line in f if line.strip()]
    assert len(chosen) == 2312 and text == "\n\n".join(chosen) + "\n"
    assert fewer_bits.corpus(tmp_path).read_text() == text  # written once, reused


def _row(key, loss):
    return {"key": key, "ok": True, "final_val_loss": loss}


def test_targets_compare_each_run_with_zero3_and_the_exports_with_rtn():
    rows = [_row("zero3", 4.0), _row("w2", 4.03), _row("g2ef", 4.06)]
    convergence.relative_to_zero3(rows)
    separate = [_row("zero3", 5.0), _row("sep16", 5.1)]
    convergence.relative_to_zero3(separate)
    exports = [{"key": "zero3", "fp_ppl": 50.0, "q4_ppl": 54.0}, {"key": "qwz4", "fp_ppl": 51.0, "q4_ppl": 51.5},
               {"key": "ft_fp", "fp_ppl": 49.0, "q4_ppl": 53.0}, {"key": "ft_qwz4", "fp_ppl": 50.0, "q4_ppl": 52.92}]
    result = {"rows": rows, "exports": exports, "separate": separate,
              "plan": {"finetune_steps": 100, "separate_steps": 300}}
    by = {(t["id"], t["measure"].split(",")[1].strip() if t["id"] != "F3" else t["measure"][:40]): t
          for t in fewer_bits.targets(result)}
    f1 = [t for t in by.values() if t["id"] == "F1"]
    assert [(t["value"], t["met"]) for t in f1] == [("+0.75%", "yes")]
    f2 = [t for t in by.values() if t["id"] == "F2"]
    assert [(t["value"], t["met"]) for t in f2] == [("+1.50%", "no")]
    f3 = [t for t in by.values() if t["id"] == "F3"]
    # from step 0: 51.5 / 54 = 0.954, closing (54 - 51.5) / (54 - 50) = 62% of RTN's loss
    assert [(t["value"], t["met"]) for t in f3] == [("0.954", "≤ 0.97: yes; half: yes"),
                                                     ("0.998", "≤ 0.97: no; half: no")]
    assert "closes 62%" in f3[0]["measure"] and "closes 2%" in f3[1]["measure"]
    f4 = [t for t in by.values() if t["id"] == "F4"]
    assert [(t["value"], t["met"]) for t in f4] == [("+2.00%", "yes")]
