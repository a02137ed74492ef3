"""rlhf.py's configuration: the shipped presets parse, and bad values name their key."""

from pathlib import Path

import pytest

from rlhf.config import STAGES, RLHFConfig, check
from trainer.config import ConfigError, parse_args

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("rlhf_*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_presets_parse_and_check(path):
    cfg = parse_args(["--config", str(path)], RLHFConfig())
    for stage in STAGES:
        check(cfg, stage)


def test_one_preset_per_stage_and_one_for_the_pipeline():
    names = {p.stem for p in CONFIGS}
    assert {"rlhf_tiny", "rlhf_sft_hh", "rlhf_reward_hh", "rlhf_dpo_hh", "rlhf_ppo_task", "rlhf_grpo_task"} <= names


@pytest.mark.parametrize("argv,key", [
    (["--ppo.epochs", "0"], "ppo.epochs"),
    (["--data.max_prompt_len", "300"], "data.max_prompt_len"),
    (["--generation.top_p", "0"], "generation.top_p"),
    (["--reward.source", "task", "--data.task", "", "--data.preferences", "pairs.jsonl"], "reward.source"),
    (["--ppo.mini_batches", "16"], "ppo.mini_batches"),
    (["--train.dist_timeout", "0"], "train.dist_timeout"),
    (["--model.n_head", "3"], "model.n_head: value 3 does not divide model.d_model"),  # as train.py says it
    (["--model.preset", "gpt9"], "model.preset: value 'gpt9' is not a preset"),
])
def test_bad_values_name_the_key(argv, key):
    cfg = parse_args(["--data.task", "word", *argv], RLHFConfig())
    with pytest.raises(ConfigError, match=key):
        check(cfg, "ppo")


def test_unknown_stage_and_missing_data():
    with pytest.raises(ConfigError, match="unknown stage 'rl'"):
        check(RLHFConfig(), "rl")
    with pytest.raises(ConfigError, match="data.task"):
        check(RLHFConfig(), "dpo")


def test_every_key_has_a_description():
    from trainer.config import all_fields

    missing = [key for key, _, doc in all_fields(RLHFConfig()) if not doc.strip()]
    assert not missing, f"keys without a description (a # comment above or beside the field): {missing}"


def test_preset_paths_resolve_relative_to_the_config_file(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    shared = (Path(__file__).resolve().parents[2] / ".." / "shared" / "data").resolve()
    for name in ("rlhf_sft_hh", "rlhf_reward_hh", "rlhf_dpo_hh"):
        cfg = parse_args(["--config", str(next(p for p in CONFIGS if p.stem == name))], RLHFConfig())
        # compared resolved: ../shared may be a symbolic link
        assert Path(cfg.data.preferences).resolve() == shared / "hh-rlhf-harmless-base-test.jsonl.gz"
        if shared.is_dir():
            assert os.path.isfile(cfg.data.preferences)
