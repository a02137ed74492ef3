"""GRPO's variants on the data-parallel runtime: 2 ranks take the one-process update for every globally
normalized loss type and advantage, with dynamic sampling dropping a different number of groups on each
rank; and the logged loss, dropped groups and overlong-masked share match a direct per-sample formula."""

import statistics

import pytest
import torch

from models.config import ModelConfig
from models.transformer import Transformer
from rlhf.common import ModelRuntime
from rlhf.config import RLHFConfig
from rlhf.grpo import grpo_step
from rlhf.rollout import layout
from trainer.distributed import DistEnv
from trainer.spawn import run_ranks

EOS, MAX_LEN, GROUP = 3, 5, 2
# Eight rollouts in groups of two: rank 0 holds groups 0 and 1, rank 1 groups 2 and 3. Group 0's rewards
# are equal (dynamic sampling drops it: one group on rank 0, none on rank 1); rows 1, 4 and 6 end with
# the EOS, the others are truncated.
SCORES = [0.5, 0.5, 1.0, 0.0, 0.2, 0.9, 1.0, 0.3]
ENDS_WITH_EOS = [False, True, False, False, True, False, True, False]
VARIANTS = {  # grpo keys; the first is checked against the direct formula (μ = 1, no KL)
    "grpo": dict(loss_type="grpo", clip_high=0.28, dynamic_sampling=True, mask_truncated_completions=True),
    "dr_grpo": dict(loss_type="dr_grpo", advantage="rloo", overlong_buffer=2, iterations=2, beta=0.04),
    "gspo": dict(loss_type="gspo", scale_rewards="batch", dynamic_sampling=True, iterations=2, clip_high=0.28),
    "dapo": dict(loss_type="dapo", advantage="reinforce_pp", beta=0.04, iterations=2, mask_truncated_completions=True),
    "nothing left": dict(dynamic_sampling=True),  # with equal rewards everywhere: every group dropped, no step
}


def _rollouts():
    g = torch.Generator().manual_seed(5)
    prompts, responses = [], []
    for eos in ENDS_WITH_EOS:
        prompts.append(torch.randint(4, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist())
        n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=g))
        responses.append(torch.randint(4, 64, (n - 1,), generator=g).tolist() + [EOS if eos else 4 + n])
    logps = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    return prompts, responses, logps


def _variants(rank, world, rows):
    """Each variant's grpo_step on this rank's rows under DDP: the actor's weights after, and the statistics."""
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    prompts, responses, logps = _rollouts()
    mine = rows[rank]
    batch = layout([prompts[i] for i in mine], [responses[i] for i in mine], [logps[i] for i in mine],
                   [""] * len(mine), 0, env.device)
    out = {}
    for name, keys in VARIANTS.items():
        cfg = RLHFConfig()
        cfg.train.precision = "fp32"
        cfg.grpo.group_size = GROUP
        # AdamW divides a weight's gradient by its own size plus eps: where that size is near eps 1e-8 (a few
        # weights of this tiny model), the two runtimes' fp32 summation orders move it apart (gspo: 8% of one
        # weight's update on an AMD EPYC, 2.4e-5); a larger eps keeps the step a smooth function of the gradient
        cfg.optim.eps = 1e-6
        for key, value in keys.items():
            setattr(cfg.grpo, key, value)
        torch.manual_seed(0)
        lm = Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=64))
        actor = ModelRuntime("actor", (lm, None), cfg, env, lr=1e-3, steps=cfg.grpo.iterations)
        reference = ModelRuntime("reference", (Transformer(lm.config), None), cfg, env, lr=None) \
            if cfg.grpo.beta > 0 else None
        scores = torch.tensor([1.0 if name == "nothing left" else SCORES[i] for i in mine])
        stats = grpo_step(actor, reference, batch, scores, cfg.grpo, MAX_LEN, EOS, 0)
        out[name] = {"actor": actor.runtime.full_state_dict(), "stats": stats}
        for m in (actor, reference):
            if m is not None:
                m.close()
    return out


def test_grpo_variants_on_two_ranks_equal_one_process_and_the_direct_formula():
    sharded = run_ranks(_variants, world_size=2, args=({0: [0, 1, 2, 3], 1: [4, 5, 6, 7]},))[0]
    single = run_ranks(_variants, world_size=1, args=({0: list(range(8))},))[0]
    torch.manual_seed(0)  # the ranks' initial actor
    start = Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=64)).state_dict()
    for name in VARIANTS:
        one, two = single[name], sharded[name]
        for key, tensor in one["actor"].items():
            torch.testing.assert_close(two["actor"][key], tensor, rtol=0, atol=1e-5, msg=f"{name} {key}")
        for key, value in one["stats"].items():
            assert two["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), f"{name} {key}"
        if name == "nothing left":
            assert all(torch.equal(one["actor"][k], p) for k, p in start.items() if k in one["actor"])
            assert one["stats"]["dropped groups"] == 4 and one["stats"]["loss"] == 0
            continue
        assert any(not torch.equal(one["actor"][k], p) for k, p in start.items() if k in one["actor"]), name
        assert one["stats"]["grad norm"] > 0, name

    # "grpo": the ratio is 1 (μ = 1), so the loss is minus the mean advantage over the sequences that
    # remain after dynamic sampling, a truncated one counting with advantage 0 (TRL's grpo averages
    # over the batch's sequences; overlong filtering zeroes a row's loss).
    advantages, sequences = 0.0, 0
    for g in range(len(SCORES) // GROUP):
        group = SCORES[GROUP * g:GROUP * g + GROUP]
        if len(set(group)) == 1:
            continue  # dropped
        mean, std = statistics.fmean(group), statistics.stdev(group)
        for i, r in enumerate(group, start=GROUP * g):
            sequences += 1
            advantages += (r - mean) / (std + 1e-6) if ENDS_WITH_EOS[i] else 0.0
    stats = single["grpo"]["stats"]
    assert stats["loss"] == pytest.approx(-advantages / sequences, rel=1e-5)
    assert stats["dropped groups"] == 1 and single["gspo"]["stats"]["dropped groups"] == 1
    assert stats["overlong-masked share"] == pytest.approx(4 / 6)  # rows 2, 3, 5, 7 of the six kept rows
    assert single["dr_grpo"]["stats"]["dropped groups"] == 0 and "overlong penalty" in single["dr_grpo"]["stats"]
    assert stats["clip-high fraction"] == stats["clip-low fraction"] == 0  # μ = 1: nothing is clipped
