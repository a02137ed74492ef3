"""The benchmark suite (scripts/bench/): what can be checked in seconds without the emulated cluster.

The cluster benchmarks themselves (ablation, peers) take minutes and run in
`python scripts/bench/suite.py --quick`; here: the registry's CLI and plans, the T table's ratios,
the report writer (tables, results, docs sections, plots), the skip paths (no root, no DeepSpeed,
no data), the link sampler's step window, the kernel benchmark on tiny sizes, one real run of
comm_volume on a tiny model checked against the ledger's bounds, and the peer runtimes training
through the Trainer like our own.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench import ablation, comm_volume, convergence, kernel_bandwidth, peers, report, runner, suite

ROOT = Path(__file__).resolve().parents[2]


def _args(name, *argv):
    return suite.parser(name).parse_args(list(argv))


@pytest.mark.parametrize("name", suite.BENCHMARKS)
def test_every_benchmark_parses_quick_and_full(name):
    for quick in (True, False):
        args = _args(name, *(["--quick"] if quick else []), "--out", "x")
        assert args.quick is quick and args.out == Path("x") and callable(suite.module(name).run)


def test_quick_plans_are_reduced_and_full_plans_cover_the_issue():
    quick, full = _args("ablation", "--quick"), _args("ablation")
    assert quick.rates == ["100mbit"] and quick.micro_batches == [4] and quick.configs == ["zero3", "zeropp"]
    assert full.rates == ["100mbit", "1gbit"] and len(full.micro_batches) == 2 and (quick.steps, full.steps) == (4, 5)
    assert full.configs == ["zero3", "qwz", "hpz", "qgz", "zeropp"]
    p_quick, p_full = peers.resolve(_args("peers", "--quick")), peers.resolve(_args("peers"))
    assert p_quick["settings"]["loopback"] == ["zeropp"] and "loopback" in p_full["settings"]
    assert {"ddp-bf16", "fsdp2-bf16", "deepspeed-bf16", "zeropp", "zero3-bf16"} <= set(p_quick["settings"]["100mbit"])
    assert (p_full["steps"], p_full["warmup"], p_full["shape"]) == (8, 2, "issue")  # issue 17: median of steps 3-8
    # quick: the ablation's model, steps and warm-up, so the suite reuses its ZeRO-3 and ZeRO++ runs
    a_quick = _args("ablation", "--quick")
    assert (p_quick["shape"], p_quick["steps"], p_quick["warmup"]) == (a_quick.shape, a_quick.steps, a_quick.warmup)
    # like-for-like compute pairs, and the node-aware-off pair only in the full run
    full_slow = set(p_full["settings"]["100mbit"])
    assert {"zeropp-c32", "zero3-bf16-c32", "ddp", "ddp-bf16", "zero3-flat", "zeropp-flat"} <= full_slow
    assert not {"zero3-flat", "zeropp-flat"} & set(p_quick["settings"]["100mbit"])
    targets = peers.resolve(_args("peers", "--plan", "targets"))["settings"]
    assert set(targets["loopback"]) == {"zeropp", "zero3-bf16", "deepspeed-bf16", "zero3-keep", "zeropp-keep", "zeropp-delta"}
    assert set(targets["100mbit"]) < full_slow
    assert convergence.resolve(_args("convergence"))["bits"] == [8, 6, 4]
    assert convergence.resolve(_args("convergence", "--quick"))["bits"] == [8]
    explicit = _args("ablation", "--quick", "--rates", "1gbit", "--configs", "qwz", "--steps", "7")
    assert explicit.rates == ["1gbit"] and explicit.configs == ["qwz"] and explicit.steps == 7
    assert "default 5, quick 4" in suite.parser("ablation").format_help()


def test_suite_cli_help_and_choices(capsys):
    with pytest.raises(SystemExit) as e:
        suite.main(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        suite.main(["--only", "nonsense"])


def _fake_runs(monkeypatch, step_ms: dict, mb: dict):
    """runner.run_jobs measuring nothing: each job's step time and link bytes from these tables (by key and
    setting, else by key); the jobs it was given are kept in `launched`."""
    launched = []

    def run_jobs(name, jobs, steps, warmup, *args, **kwargs):
        launched.extend(jobs)
        out = []
        for j in jobs:
            ms = step_ms.get((j.key, j.setting), step_ms.get(j.key, 1000.0))
            out.append(dict(key=j.key, label=j.label, setting=j.setting, micro_batch=j.micro_batch, ok=True,
                            steps=steps, warmup=warmup, shape=j.shape,
                            compute=j.compute, args=j.args, script="train.py", step_ms=ms, tokens_per_s=1e5 / ms,
                            **({"phys_tx_mb_node": mb[j.key]} if j.setting != "loopback" and j.key in mb else {})))
        return out

    monkeypatch.setattr(runner, "cluster_unavailable", lambda: None)
    monkeypatch.setattr(runner, "run_jobs", run_jobs)
    return launched


def test_every_row_passes_its_compute_dtype(monkeypatch):
    """Every train.py job passes --train.precision (bf16 or fp32, never the machine's auto), the peers' workers
    pass fp32 (their own bf16 weights do the bf16), and every row states its compute dtype."""
    launched = _fake_runs(monkeypatch, {}, {})
    monkeypatch.setattr(peers, "deepspeed_installed", lambda: True)
    result = peers.run(_args("peers"), progress=lambda s: None)
    ablation.run(_args("ablation"), progress=lambda s: None)
    ablation.run(_args("ablation", "--quick", "--precision", "fp32"), progress=lambda s: None)
    for job in launched:
        precision = job.args[job.args.index("--train.precision") + 1]
        assert precision in ("bf16", "fp32") and job.compute in ("bf16", "fp32"), job
        if job.script[0].endswith("train.py"):
            assert precision == job.compute, job
        else:
            assert precision == "fp32" and job.compute == peers.RUNTIMES[job.key][3], job
    assert {j.compute for j in launched if j.key == "zeropp"} == {"bf16", "fp32"}  # ablation --precision fp32 too
    assert all(r["compute"] in ("bf16", "fp32") for r in result["rows"])
    flat = next(j for j in launched if j.key == "zeropp-flat")
    assert flat.args[flat.args.index("--zero_optimization.node_aware_collectives") + 1] == "false"
    text = peers.markdown(result)
    assert "| compute |" in text and "bf16 (autocast, fp32 master weights)" in text
    assert "--train.precision bf16`" in text
    assert "| compute |" in suite.markdown("ablation", ablation.run(_args("ablation", "--quick"),
                                                                     progress=lambda s: None), {})


def test_quick_peers_reuse_the_ablation_runs_of_the_same_job(monkeypatch):
    """Under --quick the suite's peers run the ablation's model with its steps, so our ZeRO-3 and ZeRO++ rows at
    100mbit (bf16 compute) are the ablation's, not run twice; other models or compute dtypes are not reused."""
    launched = _fake_runs(monkeypatch, {}, {})
    monkeypatch.setattr(peers, "deepspeed_installed", lambda: True)
    ablation_result = ablation.run(_args("ablation", "--quick"), progress=lambda s: None)
    args = _args("peers", "--quick")
    args.reuse = ablation_result
    launched.clear()
    result = peers.run(args, progress=lambda s: None)
    reused = {(r["key"], r["setting"]) for r in result["rows"] if r.get("reused_from") == "ablation"}
    assert reused == {("zeropp", "100mbit"), ("zero3-bf16", "100mbit")}
    assert {(j.key, j.setting) for j in launched}.isdisjoint(reused) and launched
    assert all(r["compute"] == "bf16" for r in result["rows"])
    args = _args("peers", "--quick", "--shape", "issue")
    args.reuse = ablation_result
    assert not any(r.get("reused_from") for r in peers.run(args, progress=lambda s: None)["rows"])


def test_targets_t1_to_t6_from_the_rows(monkeypatch):
    """Issue 17's T1-T6 from (fake) peers rows and kernel rows: each ratio, its inputs and verdict."""
    step = {"zeropp": 1000.0, ("zeropp", "loopback"): 800.0, "zero3-bf16": 3000.0, ("zero3-bf16", "loopback"): 600.0,
            "ddp-bf16": 5000.0, "fsdp2-bf16": 6000.0, "deepspeed-bf16": 4500.0, ("deepspeed-bf16", "loopback"): 780.0,
            "zeropp-c32": 1500.0, "zero3-bf16-c32": 3500.0, "ddp": 6500.0, "zero3-flat": 4000.0, "zeropp-flat": 1400.0}
    _fake_runs(monkeypatch, step, {"zeropp": 6.0, "zeropp-flat": 11.0})
    monkeypatch.setattr(peers, "deepspeed_installed", lambda: True)
    result = peers.run(_args("peers", "--plan", "targets"), progress=lambda s: None)
    bf16_mb = result["model"]["params"] * 2 / 1e6
    kernels = {"clock": "cpu", "rows": [
        dict(op=op, numel=16 << 20, bits=bits, threads=threads, seconds=seconds, version="current")
        for op, bits, threads, seconds in (("copy_", None, 1, 0.006), ("quantize", 8, 1, 0.010),
                                           ("dequantize", 8, 1, 0.007), ("quantize", 8, 2, 0.001))]}
    items = suite.targets({"peers": result, "kernel_bandwidth": kernels})
    by = {}
    for it in items:
        by.setdefault(it["id"], []).append(it)
    assert by["T1"][0]["value"] == pytest.approx(1000 / 800) and by["T1"][0]["met"] is True
    t2 = by["T2"][0]
    assert t2["value"] == pytest.approx(4.5) and t2["met"] is True
    assert "DeepSpeed ZeRO-3 (bf16) [bf16 compute]" in t2["from"]
    t2_fp32 = by["T2 (fp32)"][0]  # only DDP of the three measured in fp32: its ratio, no verdict
    assert t2_fp32["value"] == pytest.approx(6500 / 1500) and t2_fp32["met"] is None
    assert "not measured: FSDP2, DeepSpeed" in t2_fp32["what"]
    assert [it["value"] for it in by["T3"]] == [pytest.approx(1.5), pytest.approx(1.3)]
    assert all(it["met"] for it in by["T3"]) and "bf16 compute" in by["T3"][0]["from"]
    assert by["T4"][0]["value"] == pytest.approx(6.0 / bf16_mb) and by["T4"][0]["met"] is True
    assert by["T4 before"][0]["value"] == pytest.approx(11.0 / bf16_mb) and by["T4 before"][0]["met"] is None
    assert [it["value"] for it in by["T5"]] == [pytest.approx(0.6), pytest.approx(6 / 7)]
    assert [it["met"] for it in by["T5"]] == [True, True]
    assert by["T6"][0]["value"] == pytest.approx(3.0) and by["T6"][0]["met"] is None
    assert by["T6 before"][0]["value"] == pytest.approx(4000 / 1400)
    assert by["T6 (fp32)"][0]["value"] == pytest.approx(3500 / 1500)
    text = "\n".join(suite.targets_markdown(items))
    assert "| T1 |" in text and "| T6 |" in text and "[fp32 compute]" in text and "2.29" in text
    nothing = suite.targets({})  # nothing measured: every line says so, no verdicts
    assert all(it["value"] is None and it["met"] is None for it in nothing)
    assert "not measured" in "\n".join(suite.targets_markdown(nothing))
    section = suite.summary_markdown({"peers": dict(result, date="2026-11-25 10:00", load_average_start=1.0)}, items)
    assert "| T1 |" in section and "--train.precision bf16" in section and "peers 2026-11-25 10:00" in section


def test_a_partial_suite_run_keeps_the_other_results_and_refreshes_the_summary(tmp_path, monkeypatch):
    """--only / --targets: the results already in --out are kept (suite.json), the summary is refreshed in
    place and the other sections are left alone."""
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"{report.TITLE}\n\nintro\n\n## Summary\n\nhand-written\n\n" + report.section("summary", "| old |")
                    + "\n## 1. Ablation\n\n" + report.section("ablation", "old ablation")
                    + "\n## 5. Kernels\n\nabout kernels\n\n" + report.section("kernel_bandwidth", "old kernels"))
    monkeypatch.setattr(report, "DOCS", docs)
    monkeypatch.setattr(report, "DOCS_IMAGES", tmp_path / "img")
    out = tmp_path / "out"
    out.mkdir()
    (out / "suite.json").write_text(json.dumps({"results": {"comm_volume": {
        "total_ratio": 0.2, "rows": [], "date": "2026-11-24 09:00", "load_average_start": 1.0}}}))
    monkeypatch.setattr(suite, "execute", lambda name, args, out, progress=print, **kw: (
        {"benchmark": name, "rows": [dict(op="copy_", numel=16 << 20, bits=None, threads=1, seconds=1.0, ms=1e3,
                                          input_gbps=1.0, vs_copy=1.0, ok=True, version="current"),
                                     dict(op="quantize", numel=16 << 20, bits=8, threads=1, seconds=2.0, ms=2e3,
                                          input_gbps=0.5, vs_copy=2.0, ok=True, version="current")], "clock": "wall",
         "date": "2026-11-25 10:00", "load_average_start": 3.0, "sizes": [16 << 20], "threads": [1], "impl": "torch",
         "dtype": "fp32", "block_size": 256, "repeats": 1, "baseline": None, "seconds": 1.0, "args": vars(args)}, []))
    assert suite.main(["--only", "kernel_bandwidth", "--out", str(out)]) == 0
    saved = json.loads((out / "suite.json").read_text())
    assert set(saved["results"]) == {"comm_volume", "kernel_bandwidth"} and saved["kept_from_earlier_runs"]
    t5 = [it for it in saved["targets"] if it["id"] == "T5"]
    assert t5[0]["value"] == pytest.approx(0.5) and t5[0]["met"] is False and t5[1]["value"] is None
    text = docs.read_text()
    assert "| old |" not in text and text.count("<!-- section:summary -->") == 1 and "old ablation" in text
    assert "old kernels" not in text and "kernel_bandwidth 2026-11-25 10:00 (load average 3.0" in text
    assert text.index("section:summary") < text.index("section:ablation")
    assert "hand-written" in text and "about kernels" in text and text.count("## 5. Kernels") == 1
    assert suite.main(["--targets", "--skip", "peers", "--out", str(out), "--no-docs"]) == 0  # peers skipped here
    assert json.loads((out / "suite.json").read_text())["results"]["kernel_bandwidth"]["args"]["sizes"] == [16 << 20]


def test_report_tables_results_plots_and_docs_sections(tmp_path):
    rows = [dict(ok=True, a="x", b=1.23456), dict(ok=False, a="y", b=None, error="boom")]
    lines = report.md_table(rows, [("a", "A", "{}"), ("b", "B", "{:.2f}"), ("c", "C", "{}")])
    assert lines[2] == "| x | 1.23 | – |" and "failed: boom" in lines[3]
    assert lines[1] == "| --- | ---: | ---: |" and report.md_table(rows, [("a", "A", "{}")] * 2, "lc")[1] == \
        "| --- | :---: |"
    paths = report.write_results({"rows": rows, "extra": [1, 2]}, tmp_path, "t")
    assert json.loads(paths[0].read_text())["extra"] == [1, 2]
    assert paths[1].read_text().splitlines()[0] == "ok,a,b,error"
    info = report.machine_info()
    assert info["cores"] >= 1 and info["torch"] and "cores" in report.machine_line(info)
    docs = tmp_path / "benchmarks.md"  # a section is appended under its heading once, then replaced in place
    report.update_docs_section(docs, "kernel_bandwidth", "first body", "## 5. Kernels")
    report.update_docs_section(docs, "ablation", "other", "## 1. Ablation")
    stamp = report.stamp({"date": "2026-11-25 10:00", "command": "cmd three"}, info)
    report.update_docs_section(docs, "kernel_bandwidth", "second body " + stamp, "## 5. Kernels")
    text = docs.read_text()
    assert text.startswith(report.TITLE) and "second body" in text and "first body" not in text
    assert text.count("<!-- section:kernel_bandwidth -->") == 1 and text.count("## 5. Kernels") == 1
    assert text.index("## 5. Kernels") < text.index("second body") < text.index("## 1. Ablation") < text.index("other")
    assert "`cmd three`" in stamp and "2026-11-25," in stamp and report.machine_line(info) in stamp
    pytest.importorskip("matplotlib")
    fig, ax = report.pyplot().subplots()
    report.bars(ax, ["g1", "g2"], {"s1": [1, None], "s2": [2, 3]}, labels={"s2": ["a", ""]})
    assert report.save(fig, tmp_path, "p").is_file()
    assert report.bar_chart(tmp_path, "q", ["g1"], {"s1": [1]}, "title", "y", line_at=1.0).is_file()


def test_render_rewrites_docs_from_a_saved_suite_json(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "DOCS", tmp_path / "benchmarks.md")
    monkeypatch.setattr(report, "DOCS_IMAGES", tmp_path / "benchmarks")
    when = {"date": "2026-11-25 10:00", "load_average_start": 1.0}
    results = {"ablation": {"skipped": "emulated cluster unavailable: root", "rows": [], **when},
               "convergence": {"skipped": "data not found", "rows": [], **when}}
    saved = {"machine": report.machine_info(), "command": "python scripts/bench/suite.py --quick", "quick": True,
             "seconds": 12.0, "results": results}
    (tmp_path / "suite.json").write_text(json.dumps(saved))
    assert suite.main(["--render", str(tmp_path / "suite.json")]) == 0
    text = (tmp_path / "benchmarks.md").read_text()
    assert "## Summary" in text and "Skipped: emulated cluster unavailable: root." in text
    assert text.index("section:ablation") < text.index("section:convergence") and "| T1 |" in text
    assert "python scripts/bench/suite.py --quick" in text  # each section says which run made it
    assert json.loads((tmp_path / "suite.json").read_text())["targets"]


def test_benchmarks_say_why_they_skip(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "cluster_unavailable", lambda: "root (run as root)")
    monkeypatch.setattr(peers, "deepspeed_installed", lambda: False)
    result = ablation.run(_args("ablation", "--quick"), progress=lambda s: None)
    assert "root" in result["skipped"] and not result["rows"]
    assert "Skipped: emulated" in suite.markdown("ablation", result, {})
    result = peers.run(_args("peers", "--quick", "--settings", "slow"), progress=lambda s: None)
    notes = " ".join(result["notes"])
    assert "not installed (pip install -r requirements-bench.txt)" in notes and "unavailable" in notes
    assert not result["rows"]
    result = peers.run(_args("peers", "--settings", "loopback", "--runtimes", "deepspeed-fp32", "deepspeed-bf16"),
                       progress=lambda s: None)  # DeepSpeed rows say so without running anything
    assert [r["ok"] for r in result["rows"]] == [False, False]
    assert all(r["error"].startswith("not installed") for r in result["rows"])
    assert "not installed" in suite.markdown("peers", result, {})
    result = convergence.run(_args("convergence", "--data", str(tmp_path / "missing.txt")), progress=lambda s: None)
    assert "not found" in result["skipped"] and "Skipped" in suite.markdown("convergence", result, {})


def test_deepspeed_config_and_reference_model():
    from trainer.config import parse_args

    cfg = parse_args(runner.train_args(4, 5))
    label, family, options, compute, _ = peers.RUNTIMES["deepspeed-hpz-regather-fp32"]
    assert compute == "fp32"
    ds = peers.deepspeed_config(cfg, **options)
    assert family == "deepspeed" and ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 2 and ds["zero_optimization"][
        "stage3_max_live_parameters"] == 0
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_clipping"] == cfg.optim.clip_grad
    assert "bf16" not in ds and peers.deepspeed_config(cfg, dtype="bf16")["bf16"] == {"enabled": True}
    m = runner.model_summary()
    assert 10.0e6 < m["params"] < 11.0e6 and m["n_layer"] == 12 and m["vocab_size"] == 4096
    issue = runner.model_summary(shape="issue")  # issue 17's: 4 layers, d_model 384, d_ff 1536, vocabulary 8192
    assert (issue["n_layer"], issue["d_model"], issue["d_ff"], issue["vocab_size"]) == (4, 384, 1536, 8192)
    assert issue["params"] == 10_293_504


def test_link_sampler_window_is_taken_at_step_boundaries():
    s = object.__new__(runner.LinkSampler)  # no cluster: just the bookkeeping
    s.samples = [(0.0, 0, [(0, 0)]), (1.0, 1, [(100, 50)]), (2.0, 2, [(300, 150)]), (3.0, 2, [(310, 160)]),
                 (4.0, 4, [(700, 350)])]
    assert s.window(2, 4) == {"seconds": 2.0, "tx": [400], "rx": [200]}
    assert s.window(2, 9) is None
    assert runner.error_tail("noise\nTraceback (most recent call last):\n  x\nValueError: boom\n") == \
        "ValueError: boom"


def test_step_stats_of_the_timed_steps():
    """The one summary of a run's logged steps (ablation, peers, tensor_parallel, separate): after the warm-up,
    median and mean step time, the runtime's timings and "rest" (of the median or the mean), the ledger in MB."""
    key = runner.STEP_KEY
    metrics = [{key: 900.0, "waiting for gathers (ms)": 500.0}, {key: 100.0, "waiting for gathers (ms)": 10.0},
               {key: 300.0, "waiting for gathers (ms)": 20.0, "cross-node sent (MB)": 1.0},
               {key: 200.0, "cross-node sent (MB)": 1.0}]
    stats = runner.step_stats(metrics, warmup=1)
    assert (stats["step_ms"], stats["step_ms_mean"], stats["timing_kinds"]) == (200.0, 200.0, ["waiting for gathers"])
    assert stats["waiting for gathers ms"] == pytest.approx(10.0) and stats["rest ms"] == pytest.approx(190.0)
    assert stats["ledger_cross_mb_rank"] == pytest.approx(2**20 / 1e6)  # logged in MiB
    assert runner.step_stats(metrics[:3], warmup=1, rest_of="mean")["rest ms"] == pytest.approx(200.0 - 15.0)


def test_kernel_benchmark_tiny_through_the_cli(tmp_path, capsys):
    args = _args("kernel_bandwidth", "--sizes", "8192", "--bits", "8", "--repeats", "1", "--threads", "1")
    result = kernel_bandwidth.run(args, progress=lambda s: None)
    ops = {(r["op"], r["bits"]) for r in result["rows"]}
    assert ("copy_", None) in ops and ("quantize", 8) in ops and ("dequant_reduce_quant", 8) in ops
    assert all(r["seconds"] > 0 for r in result["rows"])
    text = kernel_bandwidth.markdown(result)
    assert "| quantize | 8 |" in text and "8192, 1 thr: x copy" in text
    assert suite.main_one("kernel_bandwidth", ["--sizes", "8192", "--bits", "4", "--repeats", "1", "--threads", "1",
                                               "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "kernel_bandwidth.json").read_text())["rows"]
    assert (tmp_path / "kernel_bandwidth.csv").is_file() and "## 5. Quantization kernels" in capsys.readouterr().out


@pytest.mark.slow
def test_comm_volume_tiny_model_matches_the_ledger_bounds():
    """One real step on 4 spawned ranks (2 nodes x 2) of a tiny GPT, ZeRO-3 vs ZeRO++ (block 64)."""
    result = comm_volume.run(_args("comm_volume", "--tiny", "--block-size", "64"), progress=lambda s: None)
    rows = {r["collective"]: r for r in result["rows"]}
    if "backward gather" in rows:  # none where every block's buffer still holds it when the backward starts
        assert rows["backward gather"]["zeropp_cross_mb"] == 0
    assert 0.48 < rows["forward gather"]["ratio"] < 0.55  # int8 + fp16 scales over bf16
    if result["node_aware_collectives"]:  # ZeRO-3 sends (N-1)/W of the model across; int4, 2 hops: 1/L of it crosses
        assert 0.24 < rows["gradient reduce"]["ratio"] < 0.30  # 1/4, + fp32 scales per 64-element block
    else:  # ZeRO-3's flat ring: a shard to every rank of the other node
        assert rows["gradient reduce"]["ratio"] < 0.15
    # the total: the parts' ratios weighted by ZeRO-3's bytes (how many blocks the backward re-gathers is the
    # engine's business: none of this 2-block model's with a prefetch depth of 1)
    parts = [r for t, r in rows.items() if t != "total" and r.get("ratio") is not None]
    assert result["total_ratio"] == rows["total"]["ratio"]
    assert rows["total"]["ratio"] <= max(r["ratio"] for r in parts if r["zero3_cross_mb"] > 1e-3)
    assert rows["total"]["zero3_cross_mb"] == pytest.approx(sum(
        rows[t]["zero3_cross_mb"] for t in rows if t != "total"))
    assert "physical_rate" not in result and result["model"]["params"] < 1e6
    text = comm_volume.markdown(result)
    assert "| forward gather |" in text and "parameters" in text


def _peer_losses(rank, world, family, argv, resume_argv=None):
    """Train through the Trainer with a peer runtime (or, family None, the config's own); the losses
    (and those of a second run with `resume_argv`)."""
    from trainer.config import parse_args
    from trainer.loop import Trainer

    out = []
    for args in filter(None, (argv, resume_argv)):
        cfg = parse_args(args)
        peer = {"fsdp2": peers.FSDP2, "deepspeed": peers.DeepSpeed}.get(family)
        build = lambda model, zero, device, tp, weights: peer(model, cfg, weights=weights, device=device)  # noqa: E731
        trainer = Trainer(cfg, **({"build_runtime": build} if peer else {}))
        try:
            out.append(trainer.run().losses)
        finally:
            trainer.close()
    return out if resume_argv else out[0]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Config arguments of a tiny GPT on a small corpus (this checkout's docs) for 2 ranks x 2 samples,
    and the losses of the same run on one process (4 samples) with the default runtime."""
    tmp = tmp_path_factory.mktemp("peers")
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    argv = ["--model.preset", "gpt2-tiny", "--data.path", str(corpus), "--data.vocab_size", "512",
            "--data.seq_len", "32", "--data.workers", "1", "--data.cache_dir", str(tmp / "cache"),
            "--train.steps", "3", "--train.eval_interval", "100", "--train.eval_batches", "1",
            "--train.tensorboard", "false", "--train.progress_bar", "false",
            "--train.precision", "fp32"]  # exactness, not the machine's auto (bf16 autocast rounds per layout)
    one = _peer_losses(0, 1, None, argv + ["--train.micro_batch_size", "4", "--train.out_dir", str(tmp / "one")])
    return argv + ["--train.micro_batch_size", "2"], one, tmp


def _peer_family(rank, world, family, argv, resume_argv):
    """Both peer checks of `family` on the same 2 ranks: training through the Trainer and resuming
    (_peer_losses), then the peer's initialization of the meta-device models (_peer_initial_weights)."""
    return {"losses": _peer_losses(rank, world, family, argv, resume_argv),
            "init": _peer_initial_weights(rank, world, family)}


@pytest.fixture(scope="module")
def peer_ranks(tiny_run):
    """family -> each rank's _peer_family results: one spawn of 2 ranks per family, on first use, serves both
    tests of the family (a spawn of ranks importing the peer's library is most of either test's time)."""
    from trainer.spawn import run_ranks

    argv, _, tmp = tiny_run
    done = {}

    def results(family):
        if family not in done:
            first = argv + ["--train.out_dir", str(tmp / family), "--train.checkpoint_interval", "2"]
            resume = argv + ["--train.out_dir", str(tmp / f"{family}-resumed"), "--resume",
                             str(tmp / family / "checkpoints" / "step_00000002")]
            done[family] = run_ranks(_peer_family, 2, args=(family, first, resume), timeout=600)
        return done[family]

    return results


@pytest.mark.slow
@pytest.mark.parametrize("family", ["fsdp2", "deepspeed"])
def test_peer_runtimes_train_like_our_loop_through_the_trainer(family, tiny_run, peer_ranks):
    """FSDP2 and DeepSpeed on 2 ranks: the same losses as one process, and resuming from their own
    checkpoint continues the run exactly."""
    if family == "deepspeed" and not peers.deepspeed_installed():
        pytest.skip("DeepSpeed not installed (pip install -r requirements-bench.txt)")
    _, one, _ = tiny_run
    losses, resumed = peer_ranks(family)[0]["losses"]
    assert len(losses) == 3 and max(abs(losses[s] - one[s]) for s in one) < 1e-4
    assert list(resumed) == [3] and resumed[3] == pytest.approx(losses[3], abs=1e-6)


INIT_MODELS = {"gpt2-tiny": dict(vocab_size=512), "llama-tiny": dict(vocab_size=384, n_layer=3)}  # tied; untied GQA


def _meta_model(preset):
    import torch

    from models.config import ModelConfig
    from models.transformer import Transformer

    torch.manual_seed(3)
    with torch.device("meta"):
        return Transformer(ModelConfig.from_preset(preset, **INIT_MODELS[preset]))


def _peer_initial_weights(rank, world, family):
    """Each INIT_MODELS model built on the meta device and initialized by the peer runtime from InitWeights
    (FSDP2: to_empty + shards; DeepSpeed: zero.Init + GatheredParameters); the full weights gathered back,
    whether the head is still the embedding's parameter, and the largest local piece of this rank."""
    import torch

    from models.weights import InitWeights
    from trainer.config import parse_args

    cfg, out = parse_args(["--train.micro_batch_size", "1"]), {}
    for preset in INIT_MODELS:
        model = _meta_model(preset)
        if family == "fsdp2":
            module = peers.FSDP2(model, cfg, weights=InitWeights(model), device=torch.device("cpu")).module
            full = {n: p.full_tensor() for n, p in module.named_parameters()}
            local = max(p.to_local().numel() for p in module.parameters())
        else:
            import deepspeed

            module = peers.DeepSpeed(model, cfg, weights=InitWeights(model)).module
            local = max(p.ds_tensor.numel() for p in module.parameters())
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                full = {n: p.detach().clone() for n, p in module.named_parameters()}
        out[preset] = (full, module.head.weight is module.embed.tokens.weight, local)
    return out


@pytest.mark.parametrize("family", ["fsdp2", "deepspeed"])
def test_peer_meta_device_init_gives_our_initial_weights(family, peer_ranks):
    """The peers' own initialization of a meta-device model (FSDP2: fully_shard, to_empty, each shard filled;
    DeepSpeed: zero.Init, each parameter set on rank 0 and re-partitioned) gives, on 2 ranks, exactly the
    weights our runtime starts from (models.weights.materialize of InitWeights), the tied head still tied, and
    each rank holds only a shard of each parameter."""
    from models.weights import InitWeights, materialize

    if family == "deepspeed" and not peers.deepspeed_installed():
        pytest.skip("DeepSpeed not installed (pip install -r requirements-bench.txt)")
    ranks = [rank["init"] for rank in peer_ranks(family)]
    for preset in INIT_MODELS:
        reference = _meta_model(preset)
        materialize(reference, InitWeights(reference))
        want = dict(reference.named_parameters())
        tied = reference.head.weight is reference.embed.tokens.weight
        assert tied == (preset == "gpt2-tiny")
        for rank in ranks:
            full, still_tied, local = rank[preset]
            assert list(full) == list(want) and still_tied == tied, preset
            for name, p in want.items():
                assert torch_equal(full[name], p), (preset, name)
            assert local <= max(p.numel() for p in want.values()) // 2 + 1, preset


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())


def test_largest_model_search_doubles_then_bisects():
    """M2's search (memory.py --largest): doubling to the first n_layer that does not fit (the last step capped at
    --max-layers), bisection below it."""
    from scripts.bench import memory

    def fits_up_to(limit, error_at=None):
        calls = []

        def fits(n):
            calls.append(n)
            return None if n == error_at else n <= limit
        return fits, calls

    fits, calls = fits_up_to(11)
    assert memory.largest_search(fits, 2, 1024) == (11, 12, None) and calls == [2, 4, 8, 16, 12, 10, 11]
    fits, calls = fits_up_to(0)
    assert memory.largest_search(fits, 2, 1024) == (0, 1, None) and calls == [2, 1]
    fits, calls = fits_up_to(100)
    assert memory.largest_search(fits, 8, 64) == (64, None, None) and calls == [8, 16, 32, 64]
    fits, calls = fits_up_to(16)  # the last doubling capped at max_layers
    assert memory.largest_search(fits, 15, 17) == (16, 17, None) and calls == [15, 17, 16]
    fits, calls = fits_up_to(11, error_at=12)
    assert memory.largest_search(fits, 2, 1024) == (8, 16, 12)


def test_largest_model_trials_are_killed_past_the_budget():
    """The watch over a trial's process tree sums its processes' VmRSS and kills all of them past the budget (here
    a parent and the child it started, each holding 120 MB, against 160 MB); a tree under budget runs on."""
    import signal
    import time

    from scripts.bench import memory

    hold = "import time; b = b'x' * (120 << 20); time.sleep(120)"
    code = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {hold!r}]); {hold}"
    proc = subprocess.Popen([sys.executable, "-c", code])
    watch = memory._TreeWatch(proc.pid, 160 << 20, 0, interval=0.05)
    watch.start()
    try:
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        watch.stop()
        watch.kill_all()
    assert watch.killed and "budget" in watch.killed and watch.peak > 160 << 20 and len(watch.seen) == 2
    time.sleep(0.5)
    assert not any(memory._proc_tree(pid) for pid in watch.seen)  # the child is gone too
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    watch = memory._TreeWatch(proc.pid, 2 << 30, 0, interval=0.05)
    watch.start()
    assert proc.wait(timeout=60) == 0
    watch.stop()
    assert watch.killed is None and watch.peak > 0


def test_largest_model_result_and_markdown(monkeypatch, tmp_path):
    """memory.py --largest from (fake) trials: each runtime's largest n_layer and its parameters, the losses
    compared with ours at a common n_layer (not today's: other initial weights), the ratios of target M2 (against
    the peers our best row without activation checkpointing, against today any) and the table."""
    from scripts.bench import memory

    limits = {"today": 4, "ours": 11, "ours-sync": 12, "ours-sync-ac": 13, "fsdp2": 9, "deepspeed": 7}

    def trial(key, n, base, args, root):
        fit = n <= limits[key]
        out = {"n_layer": n, "seconds": 1.0, "tree_peak": (n + 4) << 30, "log": "", "fit": fit,
               "why": "" if fit else "its processes' VmRSS reached ..."}
        losses = {"1": 8.0 + n / 100 + (1e-6 if key == "deepspeed" else 0), "2": 7.5}
        return {**out, "measured": [n << 28] * 4, "predicted": [n << 28] * 4, "losses": losses} if fit else out

    monkeypatch.setattr(memory, "_largest_trial", trial)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: None)  # the data preparation
    args = _args("memory", "--largest", "--width", "256,512,4,2", "--out", str(tmp_path))
    result = memory.run(args, progress=lambda s: None)
    rows = {r["key"]: r for r in result["rows"]}
    assert {k: r["n_layer"] for k, r in rows.items()} == limits
    assert rows["ours"]["first_not_fitting"] == 12 and rows["ours"]["params"] > rows["fsdp2"]["params"]
    assert rows["fsdp2"]["predicted_gb"] is None and rows["ours"]["predicted_gb"] == pytest.approx(11 / 4)
    assert rows["deepspeed"]["loss_vs_ours"] == pytest.approx(1e-6) and rows["deepspeed"]["loss_vs_ours_at"] == 4
    assert "loss_vs_ours" not in rows["today"] and rows["ours-sync"]["loss_vs_ours_at"] == 8
    assert result["vs_best_peer"] == rows["ours-sync"]["params"] / rows["fsdp2"]["params"]
    assert result["vs_today"] == rows["ours-sync-ac"]["params"] / rows["today"]["params"] > 2  # any of ours
    assert result["target_met"] is True
    text = memory.markdown(result)
    assert "| ours: ZeRO-3 (fp32 wire), meta model" in text and "target M2" in text and "11, 12 no" in text


def test_todays_trial_is_read_from_its_log():
    """M2's "today" runs an earlier commit's train.py: its peak is rank 0's largest "memory (MB)" and its losses
    the logged "lm loss" of each iteration."""
    from scripts.bench import memory

    log = "\n".join(f" iteration {i}/3 | lm loss: {8 - i / 10:.4f} | learning rate: 1.0E-04 | memory (MB): {m} | x"
                    for i, m in ((1, "2201.6055"), (2, "2460.4844"), (3, "2460.0000")))
    result = memory._today_result(log + "\n iteration 3/3 | validation loss: 7.9181", 4)
    assert result["measured"] == [int(2460.4844 * 2**20)] * 4 and result["predicted"] is None
    assert result["losses"] == {"1": 7.9, "2": 7.8, "3": 7.7}


def test_a_benchmark_script_runs_standalone(tmp_path):
    """`python scripts/bench/NAME.py` (its directory first on sys.path, nothing of ours shadowed), and the
    suite as a script: --quick defaults resolved there too."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "peers.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: scripts/bench/peers.py" in proc.stdout, proc.stderr[-1000:]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "suite.py"), "--quick", "--no-docs",
                           "--only", "kernel_bandwidth", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-2000:]
    assert json.loads((tmp_path / "kernel_bandwidth.json").read_text())["sizes"] == [1 << 20]


def test_tensor_parallel_plans_run_keys_and_skips(monkeypatch, tmp_path):
    """The AccTFM benchmark's plans (quick: one rate; full: both rates, every part of AccTFM), its run keys,
    and why it skips (no root for the cluster, no Tiny Shakespeare), without running a job."""
    from scripts.bench import tensor_parallel as tp

    quick, full = tp.resolve(_args("tensor_parallel", "--quick")), tp.resolve(_args("tensor_parallel"))
    assert quick["rates"] == ["100mbit"] and set(full["rates"]) == {"1gbit", "100mbit"}
    assert {"plain", "k2", "k4", "topk", "q4", "topk-q4", "full"} <= set(full["runs"]) and "full" in quick["runs"]
    assert tp.parse_key("plain", full)[1] == {"size": 2}
    assert tp.parse_key("full", full, best_k=4)[1] == {"size": 2, "partitions": 4, "topk_keep_ratio": 0.5,
                                                        "quantize_bits": 4}
    assert tp.parse_key("single", full)[1] == {"size": 1}
    with pytest.raises(ValueError):
        tp.parse_key("k3", full)
    monkeypatch.setattr(runner, "cluster_unavailable", lambda: "root (run as root)")
    result = tp.run(_args("tensor_parallel", "--quick", "--data", str(tmp_path / "missing.txt")), progress=lambda s: None)
    assert not result["rows"] and "root" in result["timing_skipped"] and "not found" in result["convergence_skipped"]
    text = suite.markdown("tensor_parallel", result, {})
    assert "Timing part skipped" in text and "Convergence part skipped" in text


def test_separate_run_keys_and_model_changes(tmp_path):
    """SEPARATE's benchmark: its run keys become gradient_compression keys, an unknown one is refused, and
    --model-set changes the model every job builds (a wrong key fails in the model summary, before any run)."""
    from scripts.bench import separate

    plan = separate.resolve(_args("separate", "--model-set", "n_layer=3", "d_model=64", "--sep-set", "beta=0.01"))
    label, keys = separate.config("zpp-sep32gef", plan)
    assert "CR 32" in label and "gaussian, block 256" in label and keys["zero_quantized_gradients"] is True
    assert keys["gradient_compression.ratio"] == "32" and keys["gradient_compression.projection"] == "gaussian"
    assert keys["gradient_compression.reconstruction"] == "contractive"
    assert keys["gradient_compression.beta"] == "0.01"  # --sep-set comes last
    with pytest.raises(ValueError, match="unknown run"):
        separate.config("sep16x", plan)
    base, changed = (runner.model_summary(config_args=separate.train_args(p))
                     for p in (separate.resolve(_args("separate")), plan))
    assert (base["n_layer"], base["d_model"]) == (2, 128) and (changed["n_layer"], changed["d_model"]) == (3, 64)
    assert changed["params"] < base["params"]
    with pytest.raises((SystemExit, ValueError)):
        runner.model_summary(config_args=separate.train_args({**plan, "model_set": ["n_layers=3"]}))
