"""The benchmark suite (scripts/bench/): what can be checked in seconds without the emulated cluster.

The cluster benchmarks themselves (ablation, peers) take minutes and run in
`python scripts/bench/suite.py --quick`; here: argument parsing and plans, the summary's ratios,
tables and docs sections, the skip paths (no root, no DeepSpeed, no data), the peer runner's
argument split, the link sampler's step window, the kernel benchmark on tiny sizes, and one
real run of comm_volume on a tiny model checked against the ledger's bounds.
"""

import argparse
import json
import sys
from pathlib import Path

import pytest

from scripts.bench import ablation, comm_volume, convergence, kernels, peer_train, peers, suite


def _args(name, *argv):
    p = argparse.ArgumentParser()
    suite.module(name).add_args(p)
    suite.add_common_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("name", suite.BENCHMARKS)
def test_every_benchmark_parses_quick_and_full(name, tmp_path):
    for quick in (True, False):
        args = suite.bench_args(name, quick, tmp_path)
        assert args.quick is quick and args.out == tmp_path


def test_quick_plans_are_reduced_and_full_plans_cover_the_issue():
    quick, full = ablation.resolve(_args("ablation", "--quick")), ablation.resolve(_args("ablation"))
    assert quick["rates"] == ["100mbit"] and quick["micro_batches"] == [4] and quick["configs"] == ["zero3", "zeropp"]
    assert full["rates"] == ["100mbit", "1gbit"] and len(full["micro_batches"]) == 2
    assert full["configs"] == ["zero3", "qwz", "hpz", "qgz", "zeropp"]
    p_quick, p_full = peers.resolve(_args("peers", "--quick")), peers.resolve(_args("peers"))
    assert list(p_quick["settings"]) == ["100mbit"] and "loopback" in p_full["settings"]
    assert {"ddp", "fsdp2-fp32", "deepspeed-fp32", "zeropp"} <= set(p_quick["settings"]["100mbit"])
    assert convergence.resolve(_args("convergence"))["bits"] == [8, 6, 4]
    assert convergence.resolve(_args("convergence", "--quick"))["bits"] == [8]
    explicit = ablation.resolve(_args("ablation", "--quick", "--rates", "1gbit", "--configs", "qwz"))
    assert explicit["rates"] == ["1gbit"] and explicit["configs"] == ["qwz"]


def test_suite_cli_help_and_choices(capsys):
    with pytest.raises(SystemExit) as e:
        suite.main(["--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        suite.main(["--only", "nonsense"])


def test_summary_ratios_and_missing_values():
    z3 = dict(ok=True, key="zero3", rate="100mbit", micro_batch=4, tokens_per_s=100.0, phys_tx_mb_node=40.0)
    zpp = dict(ok=True, key="zeropp", rate="100mbit", micro_batch=4, tokens_per_s=350.0, phys_tx_mb_node=10.0)
    prow = [dict(ok=True, key="zeropp", setting_key="100mbit", family="ours", tokens_per_s=350.0, label="ZeRO++"),
            dict(ok=True, key="ddp", setting_key="100mbit", family="ddp", tokens_per_s=70.0, label="DDP"),
            dict(ok=True, key="fsdp2-fp32", setting_key="100mbit", family="fsdp2", tokens_per_s=50.0, label="F"),
            dict(ok=False, key="deepspeed-fp32", setting_key="100mbit", family="deepspeed", error="not installed"),
            dict(ok=True, key="zero3-fp32", setting_key="loopback", family="ours", tokens_per_s=120.0, label="z"),
            dict(ok=True, key="deepspeed-fp32", setting_key="loopback", family="deepspeed", tokens_per_s=100.0,
                 label="d")]
    items = suite.summary({"ablation": {"rows": [z3, zpp]}, "comm_volume": {"total_ratio": 0.22},
                           "peers": {"plan": {"rate": "100mbit"}, "rows": prow},
                           "convergence": {"rows": [dict(ok=True, key="zeropp-w8", rel_diff=0.004)]}})
    by = {it["what"].split(",")[0]: it for it in items}
    assert by["ZeRO++ / our ZeRO-3 throughput"]["value"] == pytest.approx(3.5)
    assert by["ZeRO++ / our ZeRO-3 throughput"]["met"] is True
    assert by["physical cross-node bytes per step"]["value"] == pytest.approx(0.25)
    fastest = next(it for it in items if it["what"].startswith("ZeRO++ / fastest"))
    assert fastest["value"] == pytest.approx(5.0) and "DDP" in fastest["what"]
    same = [it for it in items if it["what"].startswith("our ZeRO-3 / DeepSpeed")]
    assert [it["value"] for it in same if it["value"] is not None] == [pytest.approx(1.2)]
    assert any(it["value"] is None and it["met"] is None for it in same)   # not measured: no verdict
    assert next(it for it in items if it["what"].startswith("convergence"))["met"] is True
    text = "\n".join(suite.summary_markdown(items))
    assert "not measured" in text and "+0.40%" in text


def test_tables_results_and_docs_sections(tmp_path, monkeypatch):
    rows = [dict(ok=True, a="x", b=1.23456), dict(ok=False, a="y", b=None, error="boom")]
    lines = suite.md_table(rows, [("a", "A", "{}"), ("b", "B", "{:.2f}"), ("c", "C", "{}")])
    assert lines[2] == "| x | 1.23 | – |" and "failed: boom" in lines[3]
    paths = suite.write_results({"rows": rows, "extra": [1, 2]}, tmp_path, "t")
    assert json.loads(paths[0].read_text())["extra"] == [1, 2]
    assert paths[1].read_text().splitlines()[0] == "ok,a,b,error"
    monkeypatch.setattr(suite, "DOCS", tmp_path / "benchmarks.md")
    info = suite.machine_info()
    assert info["cores"] >= 1 and info["torch"]
    suite.update_docs_section("kernels", "first body", info, "cmd one")
    suite.update_docs_section("ablation", "other", info, "cmd two")
    suite.update_docs_section("kernels", "second body", info, "cmd three")
    text = (tmp_path / "benchmarks.md").read_text()
    assert text.startswith(suite.TITLE) and "second body" in text and "first body" not in text
    assert text.count("<!-- section:kernels -->") == 1 and "other" in text


def test_render_rewrites_docs_from_a_saved_suite_json(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "DOCS", tmp_path / "benchmarks.md")
    monkeypatch.setattr(suite, "DOCS_IMAGES", tmp_path / "benchmarks")
    results = {"ablation": {"skipped": "emulated cluster unavailable: root", "rows": []},
               "convergence": {"skipped": "data not found", "rows": []}}
    saved = {"machine": suite.machine_info(), "command": "python scripts/bench/suite.py --quick", "quick": True,
             "seconds": 12.0, "results": results}
    (tmp_path / "suite.json").write_text(json.dumps(saved))
    assert suite.main(["--render", str(tmp_path / "suite.json")]) == 0
    text = (tmp_path / "benchmarks.md").read_text()
    assert "## Summary" in text and "Skipped: emulated cluster unavailable: root." in text
    assert text.index("section:ablation") < text.index("section:convergence")
    assert json.loads((tmp_path / "suite.json").read_text())["summary"]


def test_cluster_benchmarks_say_why_they_skip(monkeypatch):
    monkeypatch.setattr(ablation, "cluster_unavailable", lambda: "root (run as root)")
    monkeypatch.setattr(peers, "cluster_unavailable", lambda: "root (run as root)")
    monkeypatch.setattr(peers, "deepspeed_installed", lambda: False)
    result = ablation.run(_args("ablation", "--quick"), progress=lambda s: None)
    assert "root" in result["skipped"] and not result["rows"]
    assert "Skipped" in ablation.markdown(result, {})
    result = peers.run(_args("peers", "--quick"), progress=lambda s: None)
    notes = " ".join(result["notes"])
    assert "not installed (pip install -r requirements-bench.txt)" in notes and "unavailable" in notes
    assert not result["rows"]


def test_deepspeed_rows_say_not_installed_without_running(monkeypatch):
    monkeypatch.setattr(peers, "deepspeed_installed", lambda: False)
    args = _args("peers", "--settings", "loopback", "--runtimes", "deepspeed-fp32", "deepspeed-bf16")
    result = peers.run(args, progress=lambda s: None)
    assert [r["ok"] for r in result["rows"]] == [False, False]
    assert all(r["error"].startswith("not installed") for r in result["rows"])
    assert "not installed" in peers.markdown(result, {})


def test_convergence_skips_without_data(tmp_path):
    result = convergence.run(_args("convergence", "--data", str(tmp_path / "missing.txt")), progress=lambda s: None)
    assert "not found" in result["skipped"]
    assert "Skipped" in convergence.markdown(result, {})


def test_peer_runner_splits_its_options_from_train_config():
    args, rest = peer_train.peer_parser().parse_known_args(
        ["--runtime", "deepspeed", "--hpz", "2", "--out", "x", "--config", "c.yaml", "--model.n_layer", "12"])
    assert args.runtime == "deepspeed" and args.hpz == 2 and rest == ["--config", "c.yaml", "--model.n_layer", "12"]
    assert peer_train.describe(args) == "DeepSpeed ZeRO-3 + hpZ (fp32)"
    from trainer.config import parse_args

    cfg = parse_args(ablation.common_train_args(4, 5))
    ds = peer_train.deepspeed_config(args, cfg)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert ds["train_micro_batch_size_per_gpu"] == 4 and "bf16" not in ds


def test_reference_model_is_about_10m_parameters():
    m = ablation.model_summary()
    assert 10.0e6 < m["params"] < 11.0e6 and m["n_layer"] == 12 and m["vocab_size"] == 4096


def test_link_sampler_window_is_taken_at_step_boundaries():
    s = object.__new__(ablation.LinkSampler)   # no cluster: just the bookkeeping
    s.samples = [(0.0, 0, [(0, 0)]), (1.0, 1, [(100, 50)]), (2.0, 2, [(300, 150)]), (3.0, 2, [(310, 160)]),
                 (4.0, 4, [(700, 350)])]
    win = s.window(2, 4)
    assert win == {"seconds": 2.0, "tx": [400], "rx": [200]}
    assert s.window(2, 9) is None


def test_kernel_benchmark_tiny(tmp_path):
    args = _args("kernels", "--sizes", "8192", "--bits", "8", "--repeats", "1", "--threads", "1")
    result = kernels.run(args, progress=lambda s: None)
    ops = {(r["op"], r["bits"]) for r in result["rows"]}
    assert ("copy_", None) in ops and ("quantize", 8) in ops and ("dequant_reduce_quant", 8) in ops
    assert all(r["seconds"] > 0 for r in result["rows"])
    text = kernels.markdown(result, {})
    assert "| quantize | 8 |" in text and "8192, 1 thr: x copy" in text
    assert kernels.main(["--sizes", "8192", "--bits", "4", "--repeats", "1", "--threads", "1",
                         "--json", str(tmp_path / "k.json")]) == 0
    assert json.loads((tmp_path / "k.json").read_text())["rows"] and (tmp_path / "k.csv").is_file()


@pytest.mark.slow
def test_comm_volume_tiny_model_matches_the_ledger_bounds():
    """One real step on 4 spawned ranks (2 nodes x 2) of a tiny GPT, ZeRO-3 vs ZeRO++ (block 64)."""
    args = _args("comm_volume", "--tiny", "--block-size", "64")
    result = comm_volume.run(args, progress=lambda s: None)
    rows = {r["collective"]: r for r in result["rows"]}
    assert rows["backward gather"]["zeropp_cross_mb"] == 0 and rows["backward gather"]["zero3_cross_mb"] > 0
    assert 0.48 < rows["forward gather"]["ratio"] < 0.55   # int8 + fp16 scales over bf16
    assert rows["gradient reduce"]["ratio"] < 0.15         # int4, 2 hops: 1/L of it crosses
    assert result["total_ratio"] == rows["total"]["ratio"] <= 0.28
    assert rows["total"]["zero3_cross_mb"] == pytest.approx(sum(
        rows[t]["zero3_cross_mb"] for t in rows if t != "total"))
    assert "physical_rate" not in result and result["model"]["params"] < 1e6
    text = comm_volume.markdown(result, {})
    assert "| forward gather |" in text and "parameters" in text


def test_scripts_run_standalone_help():
    import subprocess

    root = Path(__file__).resolve().parents[2]
    for script in ("suite", "peer_train"):   # the others' main() is run_standalone, exercised above
        proc = subprocess.run([sys.executable, str(root / "scripts" / "bench" / f"{script}.py"), "--help"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (script, proc.stderr[-1000:])
        assert "usage" in proc.stdout.lower()
