"""configs/finetune_alpaca_lora.yaml sets no zero_optimization keys, so any runtime is one override
away (issue 37, item 8d); configs/finetune_alpaca_lora_zeropp.yaml is the same run under ZeRO++."""

import math
from pathlib import Path

from tests.trainer.test_finetune import ft_args, ft_config, hf_dirs, synthetic, tokenizer_dir  # noqa: F401
from trainer.config import load_yaml
from trainer.loop import train

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_lora_preset_runs_with_stage_0_as_its_one_override(hf_dirs, synthetic, tmp_path):  # noqa: F811
    cfg = ft_config("--config", str(CONFIGS / "finetune_alpaca_lora.yaml"),
                    *ft_args(hf_dirs["llama"], synthetic, tmp_path, "--train.steps", "1", "--train.grad_accum", "1",
                             "--train.export_hf", "false", "--zero_optimization.stage", "0"))
    assert cfg.finetune.lora.r == 16 and cfg.zero_optimization.stage == 0
    result = train(cfg)
    assert math.isfinite(result.losses[1]) and math.isfinite(result.val_losses[1])


def test_the_zeropp_preset_is_the_lora_preset_plus_zero_optimization():
    lora, zeropp = (load_yaml(CONFIGS / f"{name}.yaml") for name in ("finetune_alpaca_lora",
                                                                     "finetune_alpaca_lora_zeropp"))
    zero = zeropp.pop("zero_optimization")
    assert "zero_optimization" not in lora
    assert zero["stage"] == 3 and zero["zero_quantized_nontrainable_weights"] is True
    zeropp["train"]["out_dir"] = lora["train"]["out_dir"]
    assert zeropp == lora
    for name in ("finetune_alpaca_lora", "finetune_alpaca_lora_zeropp"):
        ft_config("--config", str(CONFIGS / f"{name}.yaml"), "--finetune.hf_checkpoint", "x",
                  "--zero_optimization.stage", "3").zero_optimization.validate()
