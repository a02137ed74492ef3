import pytest

from trainer.config import Config, ConfigError, from_dict, parse_args, set_key, to_dict


def test_defaults_yaml_then_cli_override(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("optim:\n  lr: 0.01\ntrain:\n  steps: 7\n  tensorboard: false\n")
    cfg = parse_args(["--config", str(yaml_file), "--optim.lr", "3e-4", "--train.micro-batch-size=4"])
    assert cfg.optim.lr == 3e-4  # CLI beats YAML
    assert cfg.train.steps == 7  # YAML beats default
    assert cfg.train.tensorboard is False
    assert cfg.train.micro_batch_size == 4
    assert cfg.optim.beta2 == Config().optim.beta2  # untouched default


def test_unknown_key_names_it_and_lists_valid_ones():
    with pytest.raises(ConfigError) as e:
        parse_args(["--optim.learning_rate", "1e-3"])
    assert "optim.learning_rate" in str(e.value)
    assert "lr" in str(e.value) and "warmup_steps" in str(e.value)
    with pytest.raises(ConfigError, match="bogus"):
        parse_args(["--bogus.lr", "1"])


def test_unknown_key_in_yaml(tmp_path):
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="train.stepz"):
        parse_args(["--config", str(yaml_file)])


@pytest.mark.parametrize(
    "key,value,expected",
    [("train.steps", "ten", "integer"), ("optim.lr", "fast", "number"),
     ("train.tensorboard", "maybe", "boolean"), ("optim.decay", "exp", "cosine")],
)
def test_wrong_typed_value(key, value, expected):
    with pytest.raises(ConfigError) as e:
        parse_args([f"--{key}", value])
    assert key in str(e.value) and repr(value) in str(e.value) and expected in str(e.value)


def test_optional_and_bare_flag():
    cfg = parse_args(["--data.tokenizer", "tok.model", "--train.tensorboard", "--resume", "latest"])
    assert cfg.data.tokenizer == "tok.model" and cfg.train.tensorboard is True and cfg.resume == "latest"
    set_key(cfg, "data.tokenizer", "none")
    assert cfg.data.tokenizer is None


def test_missing_or_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        parse_args(["--config", str(tmp_path / "absent.yaml")])
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        parse_args(["--config", str(tmp_path / "list.yaml")])


def test_round_trip_through_dict():
    cfg = parse_args(["--optim.lr", "5e-4", "--model.n_layer", "3"])
    assert from_dict(to_dict(cfg)) == cfg


def test_shipped_presets_parse():
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml")):
        if not path.name.startswith("rlhf_"):  # rlhf.py's own config (tests/rlhf/test_config.py)
            parse_args(["--config", str(path)])
