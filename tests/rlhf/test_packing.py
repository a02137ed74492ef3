"""data.packing in rlhf.py: the packed forwards give the padded path's DPO loss and gradients, the RL
update's log-probs and values, and the same PPO / GRPO updates; the sft stage hands the key to finetune's."""

import types

import pytest
import torch

import rlhf.sft
from models.transformer import Transformer
from rlhf.common import ModelRuntime
from rlhf.config import RLHFConfig
from rlhf.grpo import grpo_update
from rlhf.losses import dpo_loss, grpo_advantages
from rlhf.pairs import _pair_batch, _response_logprob_sums
from rlhf.ppo import ppo_update
from tests.rlhf.test_stages import _setup, ppo_inputs
from trainer.distributed import DistEnv
from trainer.spawn import run_ranks


def _pairs() -> types.SimpleNamespace:
    """Six preference pairs of different lengths: a shared prompt (labels -100), then each side's response."""
    g = torch.Generator().manual_seed(3)
    items = []
    for _ in range(6):
        prompt = torch.randint(3, 64, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g)
        item = {}
        for side in ("chosen", "rejected"):
            response = torch.randint(3, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
            item[f"{side}_tokens"] = torch.cat([prompt, response])
            item[f"{side}_labels"] = torch.cat([torch.full_like(prompt, -100), response])
        items.append(item)
    return types.SimpleNamespace(dataset=items)


def _dpo(cfg, env, lm):
    policy = ModelRuntime("policy", (lm, None), cfg, env, lr=1e-3)
    reference = ModelRuntime("reference", (Transformer(lm.config), None), cfg, env, lr=None)
    batch = _pair_batch(_pairs(), list(range(6)), 0, env.device)
    with torch.no_grad():
        ref_chosen, ref_rejected = _response_logprob_sums(reference, batch).chunk(2)
    sums = _response_logprob_sums(policy, batch)
    loss = dpo_loss(*sums.chunk(2), ref_chosen, ref_rejected, beta=0.1)[0].mean()
    loss.backward()
    grads = {n: p.grad for n, p in policy.module.named_parameters()}
    out = {"sums": sums.detach(), "loss": loss.detach(), "grads": grads}
    policy.close()
    reference.close()
    return out


def _rl(cfg, env, lm):
    p = ppo_inputs(lm, cfg, env, list(range(8)))  # left-padded prompts, right-padded responses
    actor, critic, reference, batch = p["actor"], p["critic"], p["reference"], p["batch"]
    old_logp, ref_logp, old_values, scores = p["old_logp"], p["ref_logp"], p["old_values"], p["scores"]
    ppo_stats, _ = ppo_update(actor, critic, p["exp"], cfg.ppo, 0)
    cfg.grpo.group_size, cfg.grpo.iterations, cfg.grpo.beta = 2, 2, 0.04
    grpo_stats, _ = grpo_update(actor, batch, grpo_advantages(scores, 2), ref_logp, cfg.grpo, 0)
    out = {"logp": old_logp, "ref_logp": ref_logp, "values": old_values, "ppo": ppo_stats, "grpo": grpo_stats,
           "actor": actor.runtime.full_state_dict(), "critic": critic.runtime.full_state_dict()}
    for model in (actor, critic, reference):
        model.close()
    return out


def _padded_and_packed(rank, world, what):
    results = []
    for packing in (False, True):
        lm, cfg, env = _setup(rank, world, 0)  # gpt2-tiny: learned positions, which must restart per sequence
        cfg.data.packing = packing
        results.append({"dpo": _dpo, "rl": _rl}[what](cfg, env, lm))
    return results


def test_packed_dpo_equals_padded():
    padded, packed = run_ranks(_padded_and_packed, 1, args=("dpo",))[0]
    torch.testing.assert_close(packed["sums"], padded["sums"], rtol=0, atol=1e-5)
    assert abs(packed["loss"] - padded["loss"]) < 1e-6
    for name, grad in padded["grads"].items():
        torch.testing.assert_close(packed["grads"][name], grad, rtol=0, atol=1e-5, msg=name)


def test_packed_rl_update_equals_padded():
    padded, packed = run_ranks(_padded_and_packed, 1, args=("rl",))[0]
    for key in ("logp", "ref_logp", "values"):
        assert padded[key].abs().sum() > 0
        torch.testing.assert_close(packed[key], padded[key], rtol=0, atol=1e-5, msg=key)
    for model in ("actor", "critic"):  # after a PPO update, then (the actor) a GRPO one
        for name, tensor in padded[model].items():
            torch.testing.assert_close(packed[model][name], tensor, rtol=0, atol=1e-5, msg=f"{model} {name}")
    for stage in ("ppo", "grpo"):
        for key, value in padded[stage].items():
            assert packed[stage][key] == pytest.approx(value, rel=1e-4, abs=1e-6), f"{stage} {key}"


def test_the_sft_stage_packs_as_finetune_does(monkeypatch):
    monkeypatch.setattr(rlhf.sft, "base_model_dir", lambda cfg, env: "base")
    monkeypatch.setattr(rlhf.sft, "sft_file", lambda cfg, env: ("sft.jsonl", "auto"))
    cfg = RLHFConfig()
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    for packing in (False, True):
        cfg.data.packing = packing
        data = rlhf.sft.sft_config(cfg, env).data
        assert (data.packing, data.seq_len) == (packing, cfg.data.max_len - 1)
