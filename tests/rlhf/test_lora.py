"""LoRA for RL: the policy trains adapters over a frozen base, the reference is that base with the
adapters off (no second model), the update under ZeRO-3 on two ranks equals one process's, and what
is exported (adapters merged) computes what the runtime trained."""

import json
import runpy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.config import ModelConfig
from models.hf import load_hf_checkpoint
from models.transformer import Transformer
from rlhf.common import ModelRuntime
from rlhf.config import RLHFConfig
from rlhf.grpo import grpo_update
from rlhf.losses import grpo_advantages
from rlhf.rollout import layout, logprobs
from trainer.config import LoraSection
from trainer.distributed import DistEnv
from trainer.spawn import run_ranks

ROOT = Path(__file__).parents[2]
LORA = LoraSection(r=4, alpha=8.0, targets=["q_proj", "v_proj", "up_proj"])


def _batch(rank_rows):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    responses = [torch.randint(3, 64, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(8)]
    logps = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    scores = torch.randn(8, generator=g)
    batch = layout([prompts[i] for i in rank_rows], [responses[i] for i in rank_rows],
                   [logps[i] for i in rank_rows], [""] * len(rank_rows), 0, torch.device("cpu"))
    return batch, scores[rank_rows]


def _lora_grpo_step(rank, world, rows, stage):
    """Two GRPO updates of a LoRA actor (k3 KL to its own base, adapters off); what it computes after."""
    torch.manual_seed(0)
    lm = Transformer(ModelConfig.from_preset("llama-tiny", vocab_size=64))
    base = Transformer(lm.config)
    base.load_state_dict(lm.state_dict())
    cfg = RLHFConfig()
    cfg.zero_optimization.stage = stage
    cfg.zero_optimization.communication_data_type = "fp32"
    cfg.train.precision = "fp32"
    cfg.grpo.group_size, cfg.grpo.iterations, cfg.grpo.beta = 2, 2, 0.04
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    torch.manual_seed(1)  # the adapters' initialization: the same on every rank and world size
    actor = ModelRuntime("actor", (lm, None), cfg, env, lr=1e-2, steps=2, lora=LORA)
    reference = actor.without_adapters()
    batch, scores = _batch(rows[rank])
    before = logprobs(reference, batch).detach()
    stats, _ = grpo_update(actor, batch, grpo_advantages(scores, 2), before, cfg.grpo, 0)
    with torch.no_grad():
        out = {"reference before": before, "reference after": logprobs(reference, batch),
               "base": logprobs(_Plain(base), batch), "actor": logprobs(actor, batch),
               "trained": {n: p for n, p in actor.runtime.full_state_dict().items() if ".lora_" in n},
               "frozen": sorted(n for n, p in actor.module.named_parameters() if not p.requires_grad)}
        merged = actor.full_model()  # every rank calls it
        out["merged"] = logprobs(_Plain(merged), batch)
        out["merged keys"] = sorted(merged.state_dict())
    actor.close()
    return out


class _Plain:
    """A plain model where the rollout helpers expect a ModelRuntime."""

    def __init__(self, model):
        self.model = model

    def __call__(self, tokens, attention_mask=None):
        return self.model(tokens, attention_mask=attention_mask)


@pytest.mark.parametrize("stage", [0, 3])
def test_lora_grpo_trains_adapters_against_its_own_base(stage):
    two = run_ranks(_lora_grpo_step, world_size=2, args=({0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}, stage))
    one = run_ranks(_lora_grpo_step, world_size=1, args=({0: list(range(8))}, stage))[0]
    for rank, out in enumerate(two):
        rows = slice(rank * 4, rank * 4 + 4)
        # The reference is the base model, before and after the update (the adapters are off).
        torch.testing.assert_close(out["reference before"], out["base"], rtol=0, atol=1e-6)
        torch.testing.assert_close(out["reference after"], out["base"], rtol=0, atol=1e-6)
        assert (out["actor"] - out["base"]).abs().max() > 1e-4  # the policy moved
        # The merged export computes what the runtime trained.
        torch.testing.assert_close(out["merged"], out["actor"], rtol=0, atol=1e-5)
        assert not any(".lora_" in k or ".base." in k for k in out["merged keys"])
        width = out["actor"].shape[1]  # responses are right-padded to each batch's longest
        torch.testing.assert_close(out["actor"], one["actor"][rows, :width], rtol=0, atol=1e-5)
        assert one["actor"][rows, width:].abs().sum() == 0
    # Only the adapters train, and two ranks train them as one process does.
    assert all(".lora_" not in n for n in one["frozen"]) and len(one["trained"]) == 2 * 3 * 2
    for name, value in one["trained"].items():
        # as test_stages' full-weight comparisons: Adam turns reduction-order rounding of near-zero
        # gradient elements into differences of ~1e-6 (measured 1.9e-6 on values of 0.02)
        torch.testing.assert_close(two[0]["trained"][name], value, rtol=0, atol=1e-5, msg=name)


def _main(rank, world, argv):
    runpy.run_path(str(ROOT / "rlhf.py"), run_name="rlhf_script")["main"](argv)


def test_a_lora_grpo_run_keeps_one_model_and_exports_it_merged(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(ROOT)
    run_ranks(_main, world_size=1, args=(["grpo", "--config", "configs/rlhf_tiny.yaml", "--train.out_dir",
                                          str(tmp_path), "--data.task_samples", "200", "--sft.steps", "4",
                                          "--reward.source", "task", "--grpo.steps", "2", "--grpo.group_size", "2",
                                          "--grpo.beta", "0.04", "--train.micro_batch_size", "2",
                                          "--generation.max_new_tokens", "6", "--lora.r", "4",
                                          "--train.precision", "fp32"],))
    checkpoint = sorted((tmp_path / "grpo" / "checkpoints").glob("step_*"))[-1]
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["lora"]["actor"]["r"] == 4 and sorted(state["models"]) == ["actor"]  # no reference model
    sft = load_file(tmp_path / "sft" / "hf" / "model.safetensors")  # the sft stage trained LoRA too, merged
    policy = load_file(tmp_path / "grpo" / "hf" / "model.safetensors")
    assert sorted(policy) == sorted(sft)
    moved = [k for k in policy if not torch.equal(policy[k], sft[k])]
    assert moved and all(".attn." in k for k in moved)  # GPT-2: q/k/v/o, the default targets, are c_attn / c_proj
    assert load_hf_checkpoint(tmp_path / "grpo" / "hf").config == load_hf_checkpoint(tmp_path / "sft" / "hf").config
    assert "LoRA" in capfd.readouterr().out


def test_lora_dpo_against_its_adapters_off_starts_at_zero_margin(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run_ranks(_main, world_size=1, args=(["dpo", "--config", "configs/rlhf_tiny.yaml", "--train.out_dir",
                                          str(tmp_path), "--data.task_samples", "200", "--sft.steps", "4",
                                          "--dpo.steps", "3", "--dpo.lr", "1e-2", "--dpo.precompute_ref", "false",
                                          "--train.micro_batch_size", "4", "--lora.r", "4",
                                          "--train.precision", "fp32"],))
    rows = [json.loads(line) for line in open(tmp_path / "dpo" / "metrics.jsonl")]
    held_out = [r for r in rows if "held-out margin" in r]
    assert held_out[0]["step"] == 0 and held_out[0]["held-out margin"] == 0.0  # the reference is the policy's base
    assert held_out[-1]["held-out margin"] != 0.0  # and the adapters moved the policy away from it
    checkpoint = sorted((tmp_path / "dpo" / "checkpoints").glob("step_*"))[-1]
    assert sorted(json.loads((checkpoint / "state.json").read_text())["models"]) == ["policy"]
