"""rlhf.py's configuration: the shipped presets parse, and bad values name their key."""

from pathlib import Path

import pytest

from rlhf.config import STAGES, RLHFConfig, check, reward_scaling
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
    (["--grpo.clip_high", "0"], "grpo.clip_high must be > 0, got 0"),
    (["--grpo.clip", "1.5"], "grpo.clip must be below 1"),
    (["--grpo.advantage", "rloo", "--grpo.group_size", "1"], "grpo.advantage rloo needs grpo.group_size >= 2"),
    (["--grpo.advantage", "rloo", "--grpo.scale_rewards", "false"],
     "grpo.scale_rewards False applies to grpo.advantage group only"),
    (["--grpo.overlong_buffer", "65"], r"grpo.overlong_buffer must be in \[0, generation.max_new_tokens = 64\], got 65"),
    (["--grpo.overlong_penalty", "-1"], "grpo.overlong_penalty must be >= 0"),
    (["--generation.min_new_tokens", "65"],
     r"generation.min_new_tokens must be in \[0, generation.max_new_tokens = 64\], got 65"),
])
def test_bad_values_name_the_key(argv, key):
    cfg = parse_args(["--data.task", "word", *argv], RLHFConfig())
    with pytest.raises(ConfigError, match=key):
        check(cfg, "ppo")


@pytest.mark.parametrize("argv,message", [
    (["--grpo.loss_type", "sapo"], r"grpo.loss_type: value 'sapo' is not one of \['grpo', 'bnpo'"),
    (["--grpo.advantage", "gae"], r"grpo.advantage: value 'gae' is not one of \['group', 'rloo', 'reinforce_pp'\]"),
    (["--grpo.scale_rewards", "std"], r"grpo.scale_rewards: value 'std' is not one of \['group', 'batch', 'none'\]"),
])
def test_unknown_grpo_choices_are_refused_when_parsed(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--data.task", "word", *argv], RLHFConfig())


@pytest.mark.parametrize("value,meaning", [("true", "group"), ("false", "none"), ("group", "group"),
                                           ("batch", "batch"), ("none", "none")])
def test_scale_rewards_takes_trls_names_and_the_old_booleans(value, meaning):
    cfg = parse_args(["--data.task", "word", "--grpo.scale_rewards", value], RLHFConfig())
    check(cfg, "grpo")
    assert reward_scaling(cfg.grpo) == meaning


def test_grpo_defaults_are_trls():
    g = RLHFConfig().grpo
    assert (g.loss_type, g.clip, g.clip_high, reward_scaling(g), g.mask_truncated_completions) == \
        ("dapo", 0.2, None, "group", False)
    assert (g.advantage, g.dynamic_sampling, g.overlong_buffer) == ("group", False, 0)


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
