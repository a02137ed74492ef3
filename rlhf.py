"""RLHF: supervised fine-tuning, a reward model, then PPO, DPO or GRPO, every model on our runtime.

    python rlhf.py ppo --config configs/rlhf_tiny.yaml          # sft -> reward -> ppo, end to end
    torchrun --nproc-per-node 4 rlhf.py ppo --config configs/rlhf_tiny.yaml \\
        --zero_optimization.ranks_per_node 2                    # 2 nodes x 2 ranks, ZeRO++
    python rlhf.py grpo --config configs/rlhf_grpo_task.yaml     # a verifiable task, rewards by code
    python rlhf.py dpo --config configs/rlhf_dpo_hh.yaml --models.base path/to/hf_model

Stages: sft, reward, dpo, ppo, grpo. A stage whose inputs are missing runs the stages that
make them first (ppo needs <out_dir>/sft/hf and, for reward.source model, <out_dir>/reward/hf).
Every key can be overridden as --section.key value; --help lists them all (docs/rlhf.md). A user
error ends the run with one line; --debug (or ZEROPP_DEBUG=1) shows the traceback.
"""

import sys

from trainer.preemption import catch_early
catch_early()  # first: a preemption warning while torch loads or data is prepared must not kill the rank

import torch.distributed as dist

from rlhf.config import STAGES, RLHFConfig, check
from rlhf.common import setup_distributed
from trainer.config import ConfigError, help_text, parse_args
from trainer.distributed import PeerError, is_peer_failure
from trainer.heartbeat import start_heartbeat
from trainer.loop import peer_error, run_main


def _inputs(cfg: RLHFConfig, stage: str) -> tuple[list[str], list[str]]:
    """The stages whose outputs `stage` reads: (those that have not produced them yet, those whose
    output an earlier run left under out_dir and this stage reuses)."""
    needs, reused = [], []
    wanted = [("sft", cfg.sft_path(), "models.sft", cfg.models.sft)] if stage != "sft" else []
    if stage in ("ppo", "grpo") and cfg.reward.source == "model":
        wanted.append(("reward", cfg.reward_path(), "models.reward", cfg.models.reward))
    for before, path, key, given in wanted:
        if (path / "config.json").is_file():
            if not given:
                reused.append(before)
        elif given:
            raise ConfigError(f"{key} {given}: no Hugging Face model there (config.json)")
        else:
            needs.append(before)
    return needs, reused


def run_stage(stage: str, cfg: RLHFConfig, env) -> dict:
    from rlhf.grpo import run_grpo
    from rlhf.pairs import run_pairs
    from rlhf.ppo import run_ppo
    from rlhf.sft import run_sft

    needs, reused = _inputs(cfg, stage)
    for before in reused:  # a model trained by an earlier run (its runtime, its data) is said, not silent
        if env.is_main:
            print(f"rlhf.py {stage}: using the {before} model {cfg.stage_dir(before) / 'hf'} an earlier run left "
                  f"(rlhf.py {before} --train.overwrite true trains it again)", flush=True)
    for before in needs:
        if env.is_main:
            print(f"rlhf.py {stage}: running the {before} stage first (its output is missing)", flush=True)
        resume = cfg.resume
        cfg.resume = "auto"  # an interrupted earlier stage continues where it stopped
        run_stage(before, cfg, env)
        cfg.resume = resume
    if stage == "sft":
        return run_sft(cfg, env)
    if stage in ("reward", "dpo"):
        return run_pairs(stage, cfg, env)
    return run_ppo(cfg, env) if stage == "ppo" else run_grpo(cfg, env)


USAGE = f"usage: python rlhf.py <{'|'.join(STAGES)}> [--config FILE] [--section.key VALUE ...] [--debug]\n{__doc__}"


def parse(argv: list[str]) -> tuple[str, RLHFConfig] | None:
    """(stage, its config), or None after printing the help."""
    if not argv or argv[0].startswith("-"):
        if argv and argv[0] in ("-h", "--help"):
            print(help_text(RLHFConfig(), USAGE))
            return None
        sys.exit(f"rlhf.py: name a stage first: rlhf.py <{'|'.join(STAGES)}> --config FILE [--key value ...] "
                 f"(--help lists the keys)")
    stage = argv[0]
    if stage not in STAGES:  # before the options, which may ask for --help
        raise ConfigError(f"unknown stage {stage!r}: expected one of {', '.join(STAGES)}")
    cfg = parse_args(argv[1:], RLHFConfig(), usage=USAGE)
    check(cfg, stage)
    return stage, cfg


def main(argv: list[str]) -> None:
    run_main("rlhf.py", argv, parse, lambda stage_cfg: run(*stage_cfg))


def run(stage: str, cfg: RLHFConfig) -> dict:
    env, own_group = setup_distributed(cfg.train.dist_timeout)
    doing = f"rlhf.py {stage}"
    heartbeat = start_heartbeat(env.rank, env.world_size, cfg.train.dist_timeout, lambda: doing)
    try:
        return run_stage(stage, cfg, env)
    except Exception as e:  # a failed collective names the rank that stopped responding, as train.py's do
        if is_peer_failure(e) and not isinstance(e, PeerError):
            raise peer_error(e, env.rank, doing, heartbeat, cfg.train.dist_timeout) from e
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
