"""Stage 1, supervised fine-tuning: the project's fine-tuning trainer on the chosen side.

The data are the chosen dialogues of the preference pairs (prompt masked, as DeepSpeed-Chat
step 1 and TRL's SFTTrainer on HH do) or a task's demonstrations; everything else (runtime,
checkpoints, logging, the Hugging Face export to <out_dir>/sft/hf) is trainer.loop's.
"""

from __future__ import annotations

import dataclasses

from rlhf.config import RLHFConfig
from rlhf.data import base_model_dir, sft_file
from trainer.config import Config, RunSection, TrainSection
from trainer.distributed import DistEnv
from trainer.loop import Trainer


def sft_config(cfg: RLHFConfig, env: DistEnv) -> Config:
    """The fine-tuning config of the sft stage, from the rlhf config."""
    out = Config()
    out.finetune.hf_checkpoint = str(base_model_dir(cfg, env))
    path, out.finetune.data_format = sft_file(cfg, env)
    out.data.path = str(path)
    out.data.cache_dir = str(cfg.stage_dir("sft") / "data_cache")  # its tokenized examples, beside the stage
    out.data.seq_len = cfg.data.max_len - 1
    out.data.packing = cfg.data.packing
    out.data.valid_fraction = cfg.data.valid_fraction
    out.optim = dataclasses.replace(cfg.optim, lr=cfg.sft.lr)
    shared = {f.name: getattr(cfg.train, f.name) for f in dataclasses.fields(RunSection)}  # every shared key
    shared["out_dir"] = str(cfg.stage_dir("sft"))
    out.train = TrainSection(**shared, steps=cfg.sft.steps, grad_accum=cfg.sft.grad_accum, export_hf=True,
                             eval_at_start=True)
    out.zero_optimization = cfg.zero_optimization
    out.plan = cfg.plan
    out.finetune.lora = cfg.lora
    out.resume = cfg.resume
    return out


def run_sft(cfg: RLHFConfig, env: DistEnv) -> dict:
    trainer = Trainer(sft_config(cfg, env), env)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    return {"validation loss (start)": result.val_losses.get(0, float("nan")), "validation loss": result.val_loss,
            "preempted": result.preempted}
