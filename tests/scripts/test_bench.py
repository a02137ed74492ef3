"""The benchmark suite (scripts/bench/): what can be checked in seconds without the emulated cluster.

The cluster benchmarks themselves (ablation, peers) take minutes and run in
`python scripts/bench/suite.py --quick`; here: the registry's CLI and plans, the summary's ratios,
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
    assert list(p_quick["settings"]) == ["100mbit"] and "loopback" in p_full["settings"]
    assert {"ddp", "fsdp2-fp32", "deepspeed-fp32", "zeropp"} <= set(p_quick["settings"]["100mbit"])
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


def test_summary_ratios_and_missing_values(monkeypatch):
    """The ratios come from the benchmarks' own rows, here as ablation and peers compute them from (fake) runs."""
    tokens_per_s = {"zero3": 100.0, "zeropp": 350.0, "ddp": 70.0, "fsdp2-fp32": 50.0, "zero3-fp32": 120.0,
                    "deepspeed-fp32": 100.0}
    mb = {"zero3": 40.0, "zeropp": 10.0}

    def run_jobs(name, jobs, *args, **kwargs):
        return [dict(key=j.key, label=j.label, setting=j.setting, micro_batch=j.micro_batch, ok=True,
                     tokens_per_s=tokens_per_s[j.key], step_ms=1e5 / tokens_per_s[j.key],
                     phys_tx_mb_node=mb.get(j.key, 1.0)) for j in jobs]

    monkeypatch.setattr(runner, "cluster_unavailable", lambda: None)
    monkeypatch.setattr(runner, "run_jobs", run_jobs)
    monkeypatch.setattr(peers, "deepspeed_installed", lambda: False)
    ablation_result = ablation.run(_args("ablation", "--quick"), progress=lambda s: None)
    peers_result = peers.run(_args("peers", "--quick", "--runtimes", "zeropp", "ddp", "fsdp2-fp32", "deepspeed-fp32"),
                             progress=lambda s: None)
    monkeypatch.setattr(peers, "deepspeed_installed", lambda: True)
    loopback = peers.run(_args("peers", "--settings", "loopback", "--runtimes", "zero3-fp32", "deepspeed-fp32"),
                         progress=lambda s: None)
    peers_result["rows"] += loopback["rows"]
    items = suite.summary({"ablation": ablation_result, "comm_volume": {"total_ratio": 0.22}, "peers": peers_result,
                           "convergence": {"rows": [dict(ok=True, key="zeropp-w8", rel_diff=0.004)]}})
    by = {it["what"].split(",")[0]: it for it in items}
    assert by["ZeRO++ / our ZeRO-3 throughput"]["value"] == pytest.approx(3.5)
    assert by["ZeRO++ / our ZeRO-3 throughput"]["met"] is True
    assert by["physical cross-node bytes per step"]["value"] == pytest.approx(0.25)
    fastest = next(it for it in items if it["what"].startswith("ZeRO++ / fastest"))
    assert fastest["value"] == pytest.approx(5.0) and "DDP" in fastest["what"]
    same = [it for it in items if it["what"].startswith("our ZeRO-3 / DeepSpeed")]
    assert [it["value"] for it in same if it["value"] is not None] == [pytest.approx(1.2)]
    assert any(it["value"] is None and it["met"] is None for it in same)  # not measured: no verdict
    assert next(it for it in items if it["what"].startswith("convergence"))["met"] is True
    text = "\n".join(suite.summary_markdown(items))
    assert "not measured" in text and "+0.40%" in text


def test_report_tables_results_plots_and_docs_sections(tmp_path):
    rows = [dict(ok=True, a="x", b=1.23456), dict(ok=False, a="y", b=None, error="boom")]
    lines = report.md_table(rows, [("a", "A", "{}"), ("b", "B", "{:.2f}"), ("c", "C", "{}")])
    assert lines[2] == "| x | 1.23 | – |" and "failed: boom" in lines[3]
    paths = report.write_results({"rows": rows, "extra": [1, 2]}, tmp_path, "t")
    assert json.loads(paths[0].read_text())["extra"] == [1, 2]
    assert paths[1].read_text().splitlines()[0] == "ok,a,b,error"
    info = report.machine_info()
    assert info["cores"] >= 1 and info["torch"] and "cores" in report.machine_line(info)
    docs = tmp_path / "benchmarks.md"
    report.update_docs_section(docs, "kernel_bandwidth", "first body")
    report.update_docs_section(docs, "ablation", "other")
    report.update_docs_section(docs, "kernel_bandwidth", "second body " + report.stamp(info, "cmd three"))
    text = docs.read_text()
    assert text.startswith(report.TITLE) and "second body" in text and "first body" not in text
    assert text.count("<!-- section:kernel_bandwidth -->") == 1 and "other" in text and "`cmd three`" in text
    page = tmp_path / "export.md"  # an unmarked section: from its heading to the next one
    page.write_text("# E\n\n## Old\n\nold text\n\n## Next\n\nkept\n")
    report.update_docs_section(page, "old", "## Old\n\nnew text", heading="## Old")
    assert "old text" not in page.read_text() and "new text" in page.read_text() and "kept" in page.read_text()
    pytest.importorskip("matplotlib")
    fig, ax = report.pyplot().subplots()
    report.bars(ax, ["g1", "g2"], {"s1": [1, None], "s2": [2, 3]}, labels={"s2": ["a", ""]})
    assert report.save(fig, tmp_path, "p").is_file()


def test_render_rewrites_docs_from_a_saved_suite_json(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "DOCS", tmp_path / "benchmarks.md")
    monkeypatch.setattr(report, "DOCS_IMAGES", tmp_path / "benchmarks")
    results = {"ablation": {"skipped": "emulated cluster unavailable: root", "rows": []},
               "convergence": {"skipped": "data not found", "rows": []}}
    saved = {"machine": report.machine_info(), "command": "python scripts/bench/suite.py --quick", "quick": True,
             "seconds": 12.0, "results": results}
    (tmp_path / "suite.json").write_text(json.dumps(saved))
    assert suite.main(["--render", str(tmp_path / "suite.json")]) == 0
    text = (tmp_path / "benchmarks.md").read_text()
    assert "## Summary" in text and "Skipped: emulated cluster unavailable: root." in text
    assert text.index("section:ablation") < text.index("section:convergence")
    assert json.loads((tmp_path / "suite.json").read_text())["summary"]


def test_benchmarks_say_why_they_skip(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "cluster_unavailable", lambda: "root (run as root)")
    monkeypatch.setattr(peers, "deepspeed_installed", lambda: False)
    result = ablation.run(_args("ablation", "--quick"), progress=lambda s: None)
    assert "root" in result["skipped"] and not result["rows"]
    assert "Skipped: emulated" in suite.markdown("ablation", result, {})
    result = peers.run(_args("peers", "--quick"), progress=lambda s: None)
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
    label, family, options = peers.RUNTIMES["deepspeed-hpz-regather-fp32"]
    ds = peers.deepspeed_config(cfg, **options)
    assert family == "deepspeed" and ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 2 and ds["zero_optimization"][
        "stage3_max_live_parameters"] == 0
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_clipping"] == cfg.optim.clip_grad
    assert "bf16" not in ds and peers.deepspeed_config(cfg, dtype="bf16")["bf16"] == {"enabled": True}
    m = runner.model_summary()
    assert 10.0e6 < m["params"] < 11.0e6 and m["n_layer"] == 12 and m["vocab_size"] == 4096


def test_link_sampler_window_is_taken_at_step_boundaries():
    s = object.__new__(runner.LinkSampler)  # no cluster: just the bookkeeping
    s.samples = [(0.0, 0, [(0, 0)]), (1.0, 1, [(100, 50)]), (2.0, 2, [(300, 150)]), (3.0, 2, [(310, 160)]),
                 (4.0, 4, [(700, 350)])]
    assert s.window(2, 4) == {"seconds": 2.0, "tx": [400], "rx": [200]}
    assert s.window(2, 9) is None
    assert runner.error_tail("noise\nTraceback (most recent call last):\n  x\nValueError: boom\n") == \
        "ValueError: boom"


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
    assert rows["backward gather"]["zeropp_cross_mb"] == 0 and rows["backward gather"]["zero3_cross_mb"] > 0
    assert 0.48 < rows["forward gather"]["ratio"] < 0.55  # int8 + fp16 scales over bf16
    assert rows["gradient reduce"]["ratio"] < 0.15  # int4, 2 hops: 1/L of it crosses
    assert result["total_ratio"] == rows["total"]["ratio"] <= 0.28
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
        trainer = Trainer(cfg, **({"build_runtime": lambda model, zero, device, tp: peer(model, cfg)} if peer else {}))
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
            "--train.tensorboard", "false", "--train.progress_bar", "false"]
    one = _peer_losses(0, 1, None, argv + ["--train.micro_batch_size", "4", "--train.out_dir", str(tmp / "one")])
    return argv + ["--train.micro_batch_size", "2"], one, tmp


@pytest.mark.slow
@pytest.mark.parametrize("family", ["fsdp2", "deepspeed"])
def test_peer_runtimes_train_like_our_loop_through_the_trainer(family, tiny_run):
    """FSDP2 and DeepSpeed on 2 ranks: the same losses as one process, and resuming from their own
    checkpoint continues the run exactly."""
    from trainer.spawn import run_ranks

    if family == "deepspeed" and not peers.deepspeed_installed():
        pytest.skip("DeepSpeed not installed (pip install -r requirements-bench.txt)")
    argv, one, tmp = tiny_run
    first = argv + ["--train.out_dir", str(tmp / family), "--train.checkpoint_interval", "2"]
    resume = argv + ["--train.out_dir", str(tmp / f"{family}-resumed"), "--resume",
                     str(tmp / family / "checkpoints" / "step_00000002")]
    losses, resumed = run_ranks(_peer_losses, 2, args=(family, first, resume), timeout=600)[0]
    assert len(losses) == 3 and max(abs(losses[s] - one[s]) for s in one) < 1e-4
    assert list(resumed) == [3] and resumed[3] == pytest.approx(losses[3], abs=1e-6)


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
