from pathlib import Path

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


# --- field descriptions, --help, input paths ------------------------------------------------

def test_every_key_has_a_description():
    """Every key of train.py's / finetune.py's config (zero_optimization and tensor_parallel included)
    is described by its field's comment (field_docs), which --help prints."""
    from trainer.config import all_fields

    keys = all_fields(Config())
    assert len(keys) > 80
    missing = [key for key, _, doc in keys if not doc.strip()]
    assert not missing, f"keys without a description (a # comment above or beside the field): {missing}"


def test_field_docs_read_comments_above_beside_and_for_a_run_of_fields():
    from dataclasses import dataclass

    from trainer.config import field_docs

    @dataclass
    class Section:
        # Two lines
        # above.
        a: int = 1
        b: int = 2  # beside
        # A run of fields:
        c: int = 3
        d: int = 4

        e: int = 5

    assert field_docs(Section) == {"a": "Two lines above.", "b": "beside", "c": "A run of fields:",
                                   "d": "A run of fields:", "e": ""}


def test_help_lists_keys_by_section_with_type_default_and_description(capsys):
    import finetune

    with pytest.raises(SystemExit) as e:
        parse_args(["-h"], usage="usage: python train.py", hide=("finetune",))
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python train.py")
    assert "\noptim: AdamW and the learning-rate schedule\n" in out
    assert "  --optim.lr float  (default: 0.001)\n      AdamW's peak learning rate" in out
    assert "  --optim.decay {cosine,linear,constant}  (default: cosine)" in out
    assert "  --finetune.lora.targets" not in out and "--zero_optimization.stage int" in out
    with pytest.raises(SystemExit):
        parse_args(["--help"], finetune.defaults(), hide=finetune.HIDDEN)
    out = capsys.readouterr().out
    assert "  --finetune.lora.targets list[str]  (default: q_proj,k_proj,v_proj,o_proj)" in out
    assert "  --finetune.lora.init_from path | none  (default: none)" in out
    assert "  --train.out_dir str  (default: runs/finetune)" in out  # the entry point's own defaults
    assert "--model.preset" not in out and "--data.vocab_size" not in out


ROOT = Path(__file__).resolve().parents[2]


def test_preset_paths_resolve_relative_to_the_config_file(tmp_path, monkeypatch):
    """A preset's data path is relative to the YAML file, so the documented commands work from any
    directory; a path on the command line stays relative to the current directory."""
    import os

    monkeypatch.chdir(tmp_path)
    for preset in ("shakespeare", "finetune_alpaca"):
        cfg = parse_args(["--config", str(ROOT / "configs" / f"{preset}.yaml")])
        assert os.path.isabs(cfg.data.path)
        # compared resolved: ../shared may be a symbolic link
        assert Path(cfg.data.path).resolve().parent == (ROOT / ".." / "shared" / "data").resolve()
        if os.path.isdir(os.path.dirname(cfg.data.path)):  # ../shared/data is there
            assert os.path.exists(cfg.data.path)
        assert cfg.train.out_dir.startswith("runs/")  # outputs: relative to where the run starts
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "run.yaml").write_text(
        "data:\n  path: corpus.txt\n  tokenizer: ~/tok.model\nresume: latest\nfinetune:\n  lora:\n"
        "    init_from: ../adapter\n")
    cfg = parse_args(["--config", "sub/run.yaml"])
    assert cfg.data.path == str(tmp_path / "sub" / "corpus.txt")
    assert cfg.data.tokenizer == os.path.expanduser("~/tok.model")
    assert cfg.finetune.lora.init_from == str(tmp_path / "adapter")
    assert cfg.resume == "latest"  # a keyword, not a path
    assert parse_args(["--config", "sub/run.yaml", "--data.path", "here.txt"]).data.path == "here.txt"
    assert parse_args(["--config", str(ROOT / "configs" / "quickstart.yaml")]).data.path == "default"
