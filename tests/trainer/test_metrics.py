"""trainer.metrics.MetricsLogger, the one logger of every loop: grouped TensorBoard tags read back
from the run directory, the hyperparameters, the optional W&B / MLflow writers (fake modules that
record their calls: neither package is a dependency), and no progress bar outside a terminal."""

import importlib.machinery
import io
import json
import math
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

from trainer.config import Config, ConfigError, TrainSection, check_run_section
from trainer.metrics import MetricsLogger, tag

STEP = {"lm loss": 2.5, "learning rate": 1e-3, "grad norm": 0.75, "MFU %": 1.5, "tokens/s": 900.0,
        "comm sent (MB)": 0.25, "waiting for gathers (ms)": 2.0, "memory (MB)": 12.0, "reward std": 0.125,
        "skipped steps": 0}
EVAL = {"validation loss": 2.25, "validation perplexity": math.exp(2.25)}
TAGS = {"lm loss": "train/loss", "learning rate": "train/lr", "grad norm": "train/grad_norm",
        "MFU %": "perf/mfu_percent", "tokens/s": "perf/tokens_per_s", "comm sent (MB)": "comm/sent_mb",
        "waiting for gathers (ms)": "comm/wait_gather_ms", "memory (MB)": "memory/peak_mb",
        "reward std": "train/reward_std", "skipped steps": "train/skipped_steps",
        "validation loss": "eval/loss", "validation perplexity": "eval/perplexity"}


def section(tmp_path, **keys) -> TrainSection:
    return TrainSection(**{"out_dir": str(tmp_path), "steps": 4, "progress_bar": False, **keys})


def log_two_steps(log: MetricsLogger) -> None:
    log.scalars(1, STEP, total_steps=4)
    log.scalars(2, EVAL, total_steps=4)
    log.close()


def test_tensorboard_tags_are_grouped_and_the_hyperparameters_recorded(tmp_path, capsys):
    config = Config()
    config.optim.lr = 3e-4
    log_two_steps(MetricsLogger(section(tmp_path), True, config=config))

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(TAGS.values())
    for step, values in ((1, STEP), (2, EVAL)):
        for name, value in values.items():
            (event,) = events.Scalars(TAGS[name])
            assert (event.step, event.value) == (step, pytest.approx(value, rel=1e-6)), name

    content = events.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info.hparams
    assert start["optim.lr"].number_value == pytest.approx(3e-4)
    assert start["model.preset"].string_value == config.model.preset
    assert start["finetune.lora.targets"].string_value == ",".join(config.finetune.lora.targets)
    assert start["train.tensorboard"].number_value == 1  # torch writes a bool as a number
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"train/loss", "eval/loss"}

    # metrics.jsonl and the console line keep the metrics' own names.
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, **STEP}, {"step": 2, **EVAL}]
    out = capsys.readouterr().out
    assert " iteration 1/4 | lm loss: 2.5000 | learning rate: 1.000E-03 | grad norm: 0.7500" in out


def test_an_unknown_metric_goes_under_train_with_a_sanitized_name():
    assert tag("zero-advantage groups") == "train/zero_advantage_groups"
    assert tag("Reward/s (%)") == "train/reward_per_s_percent"


def fake_trackers(monkeypatch) -> list[tuple]:
    """Fake wandb and mlflow modules in sys.modules; returns the calls they receive."""
    calls = []
    run = types.SimpleNamespace(log=lambda values, step: calls.append(("wandb.log", dict(values), step)),
                                finish=lambda: calls.append(("wandb.finish",)))

    def init(**kwargs):
        calls.append(("wandb.init", kwargs))
        return run

    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    wandb.init = init
    mlflow = types.ModuleType("mlflow")
    mlflow.__spec__ = importlib.machinery.ModuleSpec("mlflow", None)
    mlflow.set_tracking_uri = lambda uri: calls.append(("mlflow.set_tracking_uri", uri))
    mlflow.start_run = lambda run_name: calls.append(("mlflow.start_run", run_name))
    mlflow.log_params = lambda params: calls.append(("mlflow.log_params", dict(params)))
    mlflow.log_metrics = lambda values, step: calls.append(("mlflow.log_metrics", dict(values), step))
    mlflow.end_run = lambda: calls.append(("mlflow.end_run",))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    return calls


def test_wandb_and_mlflow_get_the_tags_values_steps_and_hyperparameters_on_rank_0_only(tmp_path, monkeypatch):
    calls = fake_trackers(monkeypatch)
    run_dir = tmp_path / "my_run"
    t = section(run_dir, tensorboard=False, wandb_project="proj", mlflow_tracking_uri="file:/tmp/mlruns")
    check_run_section(t)
    config = Config()
    config.train = t

    MetricsLogger(t, False, config=config).close()  # not rank 0: nothing
    assert calls == []

    log_two_steps(MetricsLogger(t, True, config=config))
    kinds = [c[0] for c in calls]
    assert kinds == ["wandb.init", "mlflow.set_tracking_uri", "mlflow.start_run", "mlflow.log_params",
                     "wandb.log", "mlflow.log_metrics", "wandb.log", "mlflow.log_metrics",
                     "wandb.finish", "mlflow.end_run"]
    init = calls[0][1]
    assert (init["project"], init["name"], init["dir"]) == ("proj", "my_run", str(run_dir))
    assert calls[1][1] == "file:/tmp/mlruns" and calls[2][1] == "my_run"
    for params in (init["config"], calls[3][1]):
        assert params["optim.lr"] == config.optim.lr and params["train.wandb_project"] == "proj"
        assert params["finetune.hf_checkpoint"] == "none" and params["model.preset"] == config.model.preset
    for i, (step, values) in zip((4, 6), ((1, STEP), (2, EVAL))):
        expected = {TAGS[name]: value for name, value in values.items()}
        assert calls[i] == ("wandb.log", expected, step)
        assert calls[i + 1] == ("mlflow.log_metrics", expected, step)
    assert not (run_dir / "tensorboard").exists()


@pytest.mark.parametrize("key,package", [("wandb_project", "wandb"), ("mlflow_tracking_uri", "mlflow")])
def test_a_tracker_whose_package_is_missing_is_one_line(key, package, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # not importable, whether installed or not
    with pytest.raises(ConfigError) as e:
        check_run_section(section(tmp_path, **{key: "x"}))
    assert str(e.value) == f"train.{key} is set but the {package} package is not installed: pip install {package}"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_only_on_a_terminal(tmp_path, monkeypatch):
    t = section(tmp_path, tensorboard=False, progress_bar=True)
    log = MetricsLogger(t, True)  # pytest's captured stdout: not a terminal (a Slurm log file)
    assert log.bar is None
    log.close()
    monkeypatch.setattr(sys, "stdout", Terminal())
    log = MetricsLogger(t, True)
    assert log.bar is not None
    log.close()
